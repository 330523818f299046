"""Shared test settings: a small CapsNet so that training tests run in seconds on 2 cores."""

import os
import subprocess
import sys

import torch

from capsnet import CapsNetConfig, Router, squash

SMALL_MODEL = dict(conv_channels=16, primary_types=4, primary_dim=4, class_dim=6, decoder_hidden=(32, 64))
SMALL_FLAGS = [
    "--conv-channels",
    "16",
    "--primary-types",
    "4",
    "--primary-dim",
    "4",
    "--class-dim",
    "6",
    "--decoder-hidden",
    "32",
    "64",
]

# A tinier CapsNet for the run-folder tests (resume, selection, the folder's owner), on 16x16 RGB images
# (write_rgb) as `capsnet train` flags, one pass an epoch (on data of one's own a run otherwise repeats its images
# to CapsNet's 400 steps an epoch, which none of these tests needs); QUIET_FLAGS keeps such runs on the CPU without
# bars or TensorBoard.
TINY_RUN_FLAGS = ["--conv-channels", "8", "--primary-types", "2", "--primary-dim", "4", "--class-dim", "4",
                  "--decoder-hidden", "16", "16", "--kernel-size", "5", "--epoch-repeats", "1"]  # fmt: skip
QUIET_FLAGS = ["--device", "cpu", "--no-progress", "--no-tensorboard"]


def write_rgb(folder, *, n_train: int):
    """An .npz of `n_train` + 12 RGB images of 16x16 in 3 classes: a data set that is not the default one."""
    from capsnet.data import standins

    return standins.write_npz(folder / "rgb.npz", n_train=n_train, n_test=12, n_classes=3, shape=(16, 16, 3))


def small_config(**overrides) -> CapsNetConfig:
    return CapsNetConfig(**{**SMALL_MODEL, **overrides})


# Small settings of each registered model, for training tests that run every one (a model missing here trains
# with its defaults: covered, only slower).
SMALL_OPTIONS: dict[str, dict] = {
    "capsnet": SMALL_MODEL,
    "baseline": {"channels": (8, 8), "hidden": (32, 16)},
    "em-capsnet": {"conv_channels": 8, "primary_types": 4, "caps1_types": 4, "caps2_types": 4},
    "efficient-capsnet": {},
    "inverted-attention-capsnet": {"stem_channels": 16, "primary_types": 4, "capsule_types": (4, 4)},
    "self-routing-capsnet": {"resnet_widths": (8, 16), "resnet_blocks": 1, "primary_types": 4,
                             "capsule_types": (4,), "capsule_strides": (2,)},
    "deepcaps": {"conv_channels": 8, "cell_types": (4, 4, 4, 4), "cell_dims": (2, 4, 4, 4), "class_dim": 8,
                 "decoder_channels": (8, 4, 4)},
    "heinsen-capsnet": {"conv_channels": 8, "n_parts": 4, "in_channels": 1, "image_size": 28, "n_classes": 10},
    "cluster-capsnet": {"capsule_channels": 2, "votes": 3, "capsule_dim": 4},
}  # fmt: skip


def small_model_config(name: str):
    """The config of registered model `name` with SMALL_OPTIONS (its defaults where it has none)."""
    from capsnet.models.registry import MODELS

    return MODELS[name].config_class(**SMALL_OPTIONS.get(name, {}))


def check_bf16_autocast_routes_in_fp32() -> None:
    """Router under bf16 autocast: fp32 output close to the fp32 result, bf16 grad for u, fp32 grad for W."""
    torch.manual_seed(2)
    router = Router(64, 10, 8, 16)
    u = squash(torch.randn(4, 64, 8))
    expected = router(u)
    u_bf16 = u.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v = router(u_bf16)
    assert v.dtype == torch.float32
    assert (v - expected).abs().max().item() < 2e-2
    v.sum().backward()
    assert u_bf16.grad.dtype == torch.bfloat16 and torch.isfinite(u_bf16.grad).all()
    assert router.weight.grad.dtype == torch.float32 and torch.isfinite(router.weight.grad).all()


def run_without_extensions(code: str) -> str:
    """Runs `code` in a fresh interpreter with CAPSNET_NO_EXT=1 (no C++ kernel of capsnet.routing) and this
    checkout's src/ first on the path; asserts that it exits with status 0 and returns what it printed."""
    env = {**os.environ, "CAPSNET_NO_EXT": "1"}
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def write_digits(folder, n: int, *, offset: int = 0):
    """An MNIST-format folder (train and t10k, gzipped IDX) of `n` bundled test digits from `offset`: a small data
    set that is not the bundled sample. Returns the folder."""
    import gzip
    import struct
    from pathlib import Path

    from capsnet.data import load_dataset

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    test = load_dataset("mnist-sample").test
    arrays = {
        "images-idx3": test.images[offset : offset + n, 0].numpy(),
        "labels-idx1": test.labels[offset : offset + n].numpy(),
    }
    for split in ("train", "t10k"):
        for kind, array in arrays.items():
            header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            (folder / f"{split}-{kind}-ubyte.gz").write_bytes(
                gzip.compress(header + array.astype("uint8").tobytes(), mtime=0)
            )
    return folder


def write_plugin(folder, distribution: str, modules: dict[str, str], entry_points: dict[str, dict[str, str]]):
    """An installed distribution in `folder` (put it on sys.path or PYTHONPATH): the Python `modules` (name ->
    source) and a `{distribution}-0.1.dist-info` with its METADATA and entry_points.txt ({group: {name: value}}),
    the files an installer writes. Returns the folder."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(source, encoding="utf-8")
    info = folder / f"{distribution.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n", encoding="utf-8")
    sections = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
                for group, points in entry_points.items()]  # fmt: skip
    (info / "entry_points.txt").write_text("\n".join(sections), encoding="utf-8")
    return folder
