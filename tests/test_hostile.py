"""Hostile input: every file the CLI takes, in the variants an attacker or an accident makes (corrupt, truncated,
empty, of the wrong type, not UTF-8, with a header declaring far more than the file holds, a symlink that leads
nowhere), ends in one line on stderr, exit status 2, and nothing written. The variants are generated from one good
file of each kind (VARIANTS); the ones that used to claim gigabytes run in a subprocess under an address-space cap
(RLIMIT_AS, slow). The limits are capsnet.limits; docs/security.md lists them.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import small_config
from safetensors.torch import save_file

from capsnet import CapsNet
from capsnet.cli import main
from capsnet.fileio import atomic_open, staging_folder, temporary_beside
from capsnet.limits import MAX_CLASSES, MAX_IMAGE_SIDE

ROOT = Path(__file__).resolve().parents[1]
# The address space a hostile-input subprocess may use: importing torch and evaluating a small model fits in
# 1 GB here (measured: `import capsnet.cli` under RLIMIT_AS of 1 GB); 3 GB leaves room and is far below the
# 4 to 23 GB the files below claimed before they were checked.
AS_LIMIT = 3 << 30


def _variants(good: bytes) -> dict[str, bytes]:
    """The generic variants of a good file's bytes."""
    middle = len(good) // 2  # (corrupt: bytes of the header flipped; a flip in raw data is data, found by no check)
    return {
        "corrupt": good[:12] + bytes(b ^ 0x5A for b in good[12:76]) + good[76:],
        "truncated": good[:middle],
        "empty": b"",
        "wrong-type": b"\x89PNG\r\n\x1a\n" + bytes(100),
        "non-utf8": b"\xff\xfe\xfa" + good[3:],
        "text": b"hello, this is a text file\n" * 4,
    }


def _png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width × height greyscale pixels, with one tiny IDAT (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def _safetensors_header(shape: list[int]) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(4)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("good")
    CapsNet(config=small_config()).save_pretrained(tmp / "model")
    from PIL import Image

    Image.fromarray(np.full((28, 28), 200, np.uint8)).save(tmp / "digit.png")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (8, 28, 28), dtype=np.uint8)
    np.savez(tmp / "data.npz", x_train=x, y_train=np.arange(8) % 2, x_test=x, y_test=np.arange(8) % 2)
    (tmp / "config.yaml").write_text("epochs: 1\nbatch_size: 4\n")
    torch.save({"w": torch.zeros(2)}, tmp / "weights.pt")
    return {"dir": tmp, **{p.stem.replace(".", "_"): p for p in tmp.iterdir()}}


def _cases(good_dir: Path, out: Path) -> list[tuple[str, list[str]]]:
    """(case id, argv) for every variant of every file kind, each written under `out`."""
    model, cases = good_dir / "model", []
    config = (model / "config.json").read_bytes()
    weights = (model / "model.safetensors").read_bytes()
    meta = json.loads(config)

    def folder(name: str, config_bytes: bytes = config, weights_bytes: bytes = weights) -> Path:
        path = out / name
        path.mkdir(parents=True)
        (path / "config.json").write_bytes(config_bytes)
        (path / "model.safetensors").write_bytes(weights_bytes)
        return path

    image = str(good_dir / "digit.png")
    for kind, body in _variants(config).items():
        cases.append((f"config.json {kind}", ["predict", "--checkpoint", str(folder(f"c-{kind}", body)), image]))
    odd_configs = {
        "model_type list": {**meta, "model_type": ["capsnet"]},
        "model_type null": {**meta, "model_type": None},
        "config null": {**meta, "config": None},
        "image_size 1e9": {**meta, "config": {**meta["config"], "image_size": 10**9}},
        "n_classes 1e7": {**meta, "config": {**meta["config"], "n_classes": 10**7}},
        "conv_channels 1e6": {**meta, "config": {**meta["config"], "conv_channels": 10**6}},
    }
    for kind, value in odd_configs.items():
        path = folder(f"c-{kind.replace(' ', '-')}", json.dumps(value).encode())
        cases.append((f"config.json {kind}", ["predict", "--checkpoint", str(path), image]))
    deep = b'{"model_type": ' + b"[" * 100_000 + b"]" * 100_000 + b', "config": {}}'
    cases.append(("config.json deeply nested", ["predict", "--checkpoint", str(folder("c-deep", deep)), image]))
    state = {k: v.clone() for k, v in CapsNet(config=small_config()).state_dict().items()}
    save_file({k: v.to(torch.int8) for k, v in state.items()}, out / "int8.safetensors")
    save_file({k: v.fill_(float("nan")) for k, v in state.items()}, out / "nan.safetensors")
    weight_variants = {
        **_variants(weights),
        "int8": (out / "int8.safetensors").read_bytes(),
        "nan": (out / "nan.safetensors").read_bytes(),
        "oversized-header": _safetensors_header([10**6, 10**6]),
    }
    for kind, body in weight_variants.items():
        path = folder(f"w-{kind}", weights_bytes=body)
        cases.append((f"model.safetensors {kind}", ["predict", "--checkpoint", str(path), image]))
    for kind, body in {
        **_variants((good_dir / "digit.png").read_bytes()),
        "bomb": _png(60000, 60000),
        "81 megapixels": _png(9000, 9000),
    }.items():
        (out / f"i-{kind}.png").write_bytes(body)
        cases.append((f"image {kind}", ["predict", "--checkpoint", str(model), str(out / f"i-{kind}.png")]))
    x = np.zeros((4, 28, 28), np.uint8)
    npz = {
        "empty arrays": dict(x_test=np.zeros((0, 28, 28), np.uint8), y_test=np.zeros(0, np.int64)),
        "labels 1e9": dict(x_test=x, y_test=np.array([0, 1, 2, 10**9])),
        "float images": dict(x_test=x.astype(np.float32), y_test=np.arange(4)),
    }
    for kind, arrays in npz.items():
        np.savez(out / f"d-{kind.replace(' ', '-')}.npz", **arrays)
    for kind, body in _variants((good_dir / "data.npz").read_bytes()).items():
        (out / f"d-{kind}.npz").write_bytes(body)
    for path in sorted(out.glob("d-*.npz")):
        cases.append((f"npz {path.stem[2:]}", ["evaluate", "--checkpoint", str(model), "--dataset", str(path)]))
    yaml = {**_variants((good_dir / "config.yaml").read_bytes()), "alias bomb": _yaml_bomb(),
            "huge": b"epochs: 1\n" + b"#" * (2 << 20)}  # fmt: skip
    for kind, body in yaml.items():
        if kind in ("corrupt", "truncated"):  # (still valid YAML of a few keys)
            continue
        path = out / f"y-{kind.replace(' ', '-')}.yaml"
        path.write_bytes(body)
        cases.append((f"yaml {kind}", ["train", "--config", str(path), "--out", str(out / "run")]))
    for kind, body in _variants((good_dir / "weights.pt").read_bytes()).items():
        (out / f"p-{kind}.pt").write_bytes(body)
        argv = ["convert", "xifengguo-capsnet", str(out / f"p-{kind}.pt"), "--out", str(out / "converted")]
        cases.append((f"state.pt {kind}", argv))
    # hf-hub: references refused before any request (the ones a Hub must answer: tests/test_hf_hub.py)
    for kind, ref in (("name", "hf-hub:org/a--b"), ("no org", "hf-hub:repo"), ("traversal", "hf-hub:../../etc"),
                      ("revision traversal", "hf-hub:org/repo@../../../refs/x"),
                      ("revision newline", "hf-hub:org/repo@main\nx")):  # fmt: skip
        cases.append((f"hf-hub {kind}", ["predict", "--pretrained", ref, image]))
    lightning_ckpt = out / "epoch=0-step=6.ckpt"
    torch.save(_lightning_checkpoint(state), lightning_ckpt)
    (out / "lightning-run").mkdir()
    torch.save(_lightning_checkpoint(state), out / "lightning-run" / "last.ckpt")
    for kind, path in (("file", lightning_ckpt), ("folder", out / "lightning-run")):
        cases.append((f"lightning ckpt {kind} predict", ["predict", "--checkpoint", str(path), image]))
        cases.append((f"lightning ckpt {kind} export", ["export", "--checkpoint", str(path), "--out",
                                                        str(out / "x.pt2")]))  # fmt: skip
    cases.append(("lightning ckpt convert", ["convert", "xifengguo-capsnet", str(lightning_ckpt), "--out",
                                             str(out / "converted")]))  # fmt: skip
    os.symlink(out / "nowhere", out / "dangling")
    os.symlink(out / "loop", out / "loop")
    for kind in ("dangling", "loop"):
        cases.append((f"symlink {kind} checkpoint", ["predict", "--checkpoint", str(out / kind), image]))
        cases.append((f"symlink {kind} image", ["predict", "--checkpoint", str(model), str(out / kind)]))
        cases.append((f"symlink {kind} yaml", ["train", "--config", str(out / kind), "--out", str(out / "run")]))
    return cases


def _lightning_checkpoint(state: dict) -> dict:
    """What a Lightning Trainer saves of a capsnet.lightning.CapsuleModule (its keys, without Lightning)."""
    return {"epoch": 0, "global_step": 6, "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"model.{k}": v for k, v in state.items()}, "loops": {}, "callbacks": {},
            "optimizer_states": [], "lr_schedulers": [], "hparams_name": "kwargs",
            "hyper_parameters": {"model_type": "capsnet", "config": {}, "lr": 1e-3}}  # fmt: skip


def _yaml_bomb() -> bytes:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def cases(good, tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    return out, dict(_cases(good["dir"], out))


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def test_every_hostile_file_is_one_line_exit_2_and_writes_nothing(cases, monkeypatch, tmp_path, capsys):
    out, argvs = cases
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
    assert len(argvs) >= 50
    failures = []
    for case, argv in argvs.items():
        before = _listing(out)
        code = main(argv)
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or "Traceback" in err or not lines[0].startswith("capsnet "):
            failures.append(f"{case}: exit {code}, stderr {err[-300:]!r}")
        elif _listing(out) != before:
            failures.append(f"{case}: wrote {sorted(_listing(out) - before)}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("config.json model_type list", "model_type must be a string, got list"),
        ("config.json image_size 1e9", f"image_size: 1000000000 is more than the limit of {MAX_IMAGE_SIDE:,}"),
        ("config.json n_classes 1e7", f"n_classes: 10000000 is more than the limit of {MAX_CLASSES:,}"),
        ("config.json conv_channels 1e6", "parameters, more than the limit of 500,000,000 (MAX_PARAMETERS)"),
        ("config.json deeply nested", "nested too deeply"),
        ("config.json non-utf8", "not UTF-8 text"),
        ("model.safetensors int8", "holds int8, the model's is float32"),
        ("model.safetensors nan", "holds NaN or infinite values"),
        ("image bomb", "could be decompression bomb DOS attack"),  # (Pillow's own guard, at twice its default)
        ("image 81 megapixels", "9000×9000 pixels is more than the 64,000,000 an image may have (MAX_IMAGE_PIXELS)"),
        ("npz labels-1e9", "labels reach 1,000,000,000; at most 100,000 classes (MAX_CLASSES)"),
        ("npz empty-arrays", "holds no images"),
        ("yaml alias bomb", "YAML aliases (*name) are not accepted"),
        ("yaml huge", "larger than the 1,048,576 bytes a config file may have"),
        ("yaml non-utf8", "not UTF-8 text"),
        ("state.pt text", "not a PyTorch checkpoint that loads with weights_only=True"),
        ("hf-hub revision traversal", "'../../../refs/x' is not a revision"),
        ("hf-hub no org", "'repo' is not a repository ORG/NAME"),
        ("lightning ckpt file predict", "a Lightning checkpoint: load it with capsnet.lightning.CapsuleModule"),
        ("lightning ckpt folder predict", "a Lightning checkpoint: load it with capsnet.lightning.CapsuleModule"),
    ],
)
def test_the_line_says_what_is_wrong(cases, case, words, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
    assert main(cases[1][case]) == 2
    assert words in capsys.readouterr().err


def test_capsnet_debug_prints_the_whole_traceback(cases, capsys, monkeypatch):
    monkeypatch.setenv("CAPSNET_DEBUG", "1")
    assert main(cases[1]["config.json model_type list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.strip().splitlines()[-1].startswith("capsnet predict: error: ")


def test_a_bug_keeps_its_traceback(good, monkeypatch):
    from capsnet.cli import build_parser

    argv = ["predict", "--checkpoint", str(good["dir"] / "model"), str(good["digit"])]
    func = build_parser().parse_args(argv).func

    def bug(args):
        raise IndexError("a bug")

    monkeypatch.setattr(sys.modules[func.__module__], func.__name__, bug)
    with pytest.raises(IndexError, match="a bug"):
        main(argv)


def test_input_errors_of_every_kind_are_one_line():
    from capsnet.cli import input_error_line

    assert input_error_line(PermissionError(13, "Permission denied", "/w/model.safetensors")) == (
        "/w/model.safetensors: Permission denied"
    )
    assert input_error_line(MemoryError()).startswith("out of memory")
    assert "wrong encoding" in input_error_line(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    from PIL import Image

    assert "too large to decode" in input_error_line(Image.DecompressionBombError("big"))
    for bug in (IndexError("x"), KeyError("x"), TypeError("x"), RecursionError()):
        assert input_error_line(bug) is None


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    from capsnet import fileio
    from capsnet.cli import os_error_line

    target = tmp_path / "state.pt"
    target.write_bytes(b"the last checkpoint")

    def full(fd):
        raise OSError(28, "No space left on device")  # (what a write or fsync on a full disk raises: no file name)

    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(OSError) as caught, atomic_open(target, "wb") as f:
        f.write(b"x" * 10)
    assert os_error_line(caught.value) == f"{target}: No space left on device"
    assert target.read_bytes() == b"the last checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_a_planted_symlink_is_never_followed(tmp_path, monkeypatch):
    """Every temporary name is random (mkstemp, O_EXCL): a symlink planted at any name a writer could pick is left
    alone, and the file it points to is untouched."""
    import tempfile

    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file")
    names = iter(["planted"] * 3 + ["fresh"] * 100)
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    os.symlink(victim, tmp_path / ".model.onnx.planted.tmp.onnx")
    os.symlink(victim, tmp_path / ".state.pt.planted.tmp")
    with temporary_beside(tmp_path / "model.onnx", suffix=".onnx") as tmp:
        assert tmp.name == ".model.onnx.fresh.tmp.onnx" and not tmp.is_symlink()
        tmp.write_bytes(b"export")
    with atomic_open(tmp_path / "state.pt") as f:
        f.write(b"state")
    assert victim.read_text() == "another user's file" and (tmp_path / "state.pt").read_bytes() == b"state"


def test_a_staging_folder_is_private_and_leaves_nothing_unless_renamed(tmp_path):
    """A folder is built in a random mkdtemp folder (mode 0700) beside its target: renamed, it is the target; failed,
    nothing of it is left, and the target keeps what it held."""
    target = tmp_path / "case"
    with staging_folder(target) as staging:
        assert staging.parent == tmp_path and staging.stat().st_mode & 0o777 == 0o700
        (staging / "a.png").write_bytes(b"image")
        staging.rename(target)
    assert [p.name for p in tmp_path.iterdir()] == ["case"] and (target / "a.png").read_bytes() == b"image"
    with pytest.raises(RuntimeError), staging_folder(target) as staging:
        (staging / "b.png").write_bytes(b"half")
        raise RuntimeError("killed while writing")
    assert [p.name for p in tmp_path.iterdir()] == ["case"] and [p.name for p in target.iterdir()] == ["a.png"]


def test_export_writes_through_a_random_temporary(tmp_path, monkeypatch):
    """models/export.py's temporary file is mkstemp's, beside --out: a symlink at the old fixed name is ignored."""
    from capsnet import export_model

    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file")
    os.symlink(victim, tmp_path / ".model.tmp.pt2")
    model = CapsNet(config=small_config())
    pytest.importorskip("torch.export")
    export_model(model, tmp_path / "model.pt2", check=False)
    assert victim.read_text() == "another user's file" and (tmp_path / "model.pt2").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.tmp.pt2", "model.pt2", "victim.txt"]


def test_capsnet_mirrors_that_is_not_a_url_is_one_line(monkeypatch):
    from capsnet.data.download import mirror_list
    from capsnet.errors import ConfigError

    monkeypatch.setenv("CAPSNET_MIRRORS", "ftp//nowhere, http://ok.example/")
    with pytest.raises(ConfigError, match=r"CAPSNET_MIRRORS: 'ftp//nowhere' is not an http\(s\):// URL"):
        mirror_list("mnist")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["npz labels-1e9", "yaml alias bomb", "config.json image_size 1e9", "image bomb"])
def test_under_an_address_space_cap(cases, case, tmp_path):
    """The files that claimed gigabytes, in a subprocess whose address space is capped at AS_LIMIT: one line."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({AS_LIMIT}, {AS_LIMIT}))\n"
        "from capsnet.cli import main\n"
        f"sys.exit(main({cases[1][case]!r}))\n"
    )
    env = {**os.environ, "CAPSNET_DATA": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr[-500:]


def test_a_mat_file_declaring_a_huge_array_is_refused_before_it_is_read(tmp_path, capsys):
    """An SVHN .mat of 272 bytes whose header declares X of 12 × 10^9 values: refused from the header (scipy's
    whosmat), before loadmat allocates; one line, exit 2, no run folder."""
    sio = pytest.importorskip("scipy.io")
    from capsnet.data.svhn import FILES, read_mat
    from capsnet.errors import DatasetError

    buf = io.BytesIO()
    sio.savemat(buf, {"X": np.zeros((2, 2, 3, 1), np.uint8), "y": np.ones((1, 1))}, do_compression=False)
    dims = np.array([2, 2, 3, 1], np.int32).tobytes()
    assert buf.getvalue().count(dims) == 1  # the X's dimensions, patched to N = 10^9
    hostile = buf.getvalue().replace(dims, np.array([2, 2, 3, 10**9], np.int32).tobytes())
    folder = tmp_path / "svhn"
    folder.mkdir()
    for name in FILES:
        (folder / name).write_bytes(hostile)
    with pytest.raises(DatasetError, match=r"variable X \[2, 2, 3, 1000000000\]: .*MAX_ARRAY_ELEMENTS"):
        read_mat(folder / FILES[0])
    out = tmp_path / "run"
    assert main(["train", "--dataset", str(folder), "--out", str(out), "--epochs", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MAX_ARRAY_ELEMENTS" in err[0] and not out.exists(), err


def test_a_lightning_checkpoint_as_the_state_to_resume_is_one_line(tmp_path, capsys):
    from helpers import write_rgb

    data, out = write_rgb(tmp_path, n_train=16), tmp_path / "run"
    assert _tiny_run(out, data, "--epochs", "1") == 0
    state = torch.load(out / "state.pt", weights_only=True)
    torch.save(_lightning_checkpoint(state["model"]), out / "state.pt")
    before = _files(out)
    capsys.readouterr()
    assert _tiny_run(out, data, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state.pt: not a capsnet training state" in err[0], err
    assert _files(out) == before


@pytest.mark.parametrize("bad", ["http://[::1/mnist/", "https://[fe80::1%25eth0/x", "http://[zz]/"])
def test_capsnet_mirrors_holding_a_malformed_ipv6_url_is_one_line(monkeypatch, tmp_path, capsys, bad):
    from capsnet.data.download import mirror_list
    from capsnet.errors import ConfigError

    monkeypatch.setenv("CAPSNET_MIRRORS", bad)
    with pytest.raises(ConfigError, match=r"CAPSNET_MIRRORS: .* is not an http\(s\):// URL"):
        mirror_list("mnist")
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
    assert main(["data", "info", "mnist"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CAPSNET_MIRRORS" in err[0] and not (tmp_path / "cache").exists(), err


def test_a_pretrained_url_with_a_malformed_ipv6_host_is_one_line(tmp_path, capsys, good):
    url = "https://[::1/models/small#sha256=" + "0" * 64
    assert main(["predict", "--pretrained", url, str(good["digit"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a valid URL" in err[0], err


def _tiny_run(out: Path, data: Path, *extra: str) -> int:
    from helpers import QUIET_FLAGS, TINY_RUN_FLAGS

    return main(["train", "--dataset", str(data), "--out", str(out), "--batch-size", "8", *TINY_RUN_FLAGS,
                 *QUIET_FLAGS, *extra])  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_state_without_an_optimizer_given_to_resume_is_one_line(tmp_path, capsys):
    from helpers import write_rgb

    data, out = write_rgb(tmp_path, n_train=16), tmp_path / "run"
    assert _tiny_run(out, data, "--epochs", "1") == 0
    state = torch.load(out / "state.pt", weights_only=True)
    del state["optimizer"]
    torch.save(state, out / "state.pt")
    before = _files(out)
    capsys.readouterr()
    assert _tiny_run(out, data, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state.pt" in err[0] and "optimizer" in err[0] and "Traceback" not in err[0], err
    assert _files(out) == before


def test_a_full_disk_while_train_writes_its_checkpoint_is_one_line_and_keeps_the_set(tmp_path, capsys, monkeypatch):
    """The disk fills while torch.save streams state.pt (the checkpoint's commit point) into its temporary file: one
    line naming state.pt, and the checkpoint set of the epoch before (state.pt, last/, best/, summary.csv) whole."""
    from helpers import write_rgb

    from capsnet import fileio

    data, out = write_rgb(tmp_path, n_train=16), tmp_path / "run"
    assert _tiny_run(out, data, "--epochs", "1") == 0
    before = _files(out)
    real_fdopen = fileio.os.fdopen

    class FullDisk:
        """state.pt's temporary file on a disk with ROOM bytes left: the writes past them raise ENOSPC, as the
        system's write(2) gives it (no file name). torch.save has then written part of the archive."""

        ROOM = 1000

        def __init__(self, f):
            self._f, self._left = f, self.ROOM

        def write(self, data):
            if len(data) > self._left:
                raise OSError(28, "No space left on device")
            self._left -= len(data)
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        return FullDisk(f) if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(".state.pt.") else f

    monkeypatch.setattr(fileio.os, "fdopen", fdopen)
    capsys.readouterr()
    assert _tiny_run(out, data, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"capsnet train: error: {out / 'state.pt'}: No space left on device"], err
    monkeypatch.undo()
    after = _files(out)
    checkpoint = {k for k in before if k.startswith(("state.pt", "last/", "best/", "summary.csv"))}
    assert len(checkpoint) == 6 and {k: after[k] for k in checkpoint} == {k: before[k] for k in checkpoint}
    assert set(after) == set(before)  # no temporary file left (the run's config.json records --epochs 2)
    assert torch.load(out / "state.pt", weights_only=True)["epoch"] == 1
