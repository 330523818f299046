"""Every data reader on files written here in the real formats, good and bad; format detection; the image-folder
cache and its skip-and-warn path."""

from __future__ import annotations

import gzip
import os
import pickle
import time

import numpy as np
import pytest
import torch

from capsnet.data import folder as folder_mod
from capsnet.data import load_dataset, standins
from capsnet.data.download import extract_members
from capsnet.data.smallnorb import PREFIX, read_matrix
from capsnet.data.sources import detect
from capsnet.errors import CapsNetError, DatasetError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------------ .npz
def test_npz_good(tmp_path):
    path = standins.write_npz(tmp_path / "d.npz", shape=(20, 24, 3), n_classes=3)
    ds = load_dataset(str(path))
    assert detect(path) == "npz" and ds.name == "d" and ds.n_classes == 3
    assert tuple(ds.train.images.shape) == (40, 3, 20, 24) and ds.train.images.dtype.is_floating_point is False
    grey = load_dataset(str(standins.write_npz(tmp_path / "g.npz", shape=(9, 7))))
    assert tuple(grey.test.images.shape) == (20, 1, 9, 7)
    z = np.load(path)
    np.testing.assert_array_equal(ds.train.images.numpy(), z["x_train"].transpose(0, 3, 1, 2))


def test_npz_bad(tmp_path):
    x, y = np.zeros((4, 5, 5), np.uint8), np.array([0, 1, 0, 1])
    cases = {
        "lengths": dict(x_train=x, y_train=y[:3], x_test=x, y_test=y),
        "one_class": dict(x_train=x, y_train=y * 0, x_test=x, y_test=y * 0),
        "range": dict(x_train=x, y_train=y, x_test=x, y_test=y + 1, class_names=np.array(["a", "b"])),
        "negative": dict(x_train=x, y_train=y - 1, x_test=x, y_test=y),
        "float_images": dict(x_train=x.astype(np.float32), y_train=y, x_test=x, y_test=y),
        "no_test": dict(x_train=x, y_train=y),
    }
    messages = {
        "lengths": "4 images but 3 labels",
        "one_class": "only one class",
        "range": "label 2 is out of range",
        "negative": "label -1 is out of range",
        "float_images": "expected uint8",
        "no_test": "no x_test",
    }
    for name, arrays in cases.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(DatasetError, match=messages[name]) as e:
            load_dataset(str(tmp_path / f"{name}.npz"))
        one_line(e)
    np.savez(tmp_path / "obj.npz", x_train=np.array([object()] * 2), y_train=y, x_test=x, y_test=y)
    with pytest.raises(DatasetError, match="without pickle"):
        load_dataset(str(tmp_path / "obj.npz"))
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DatasetError, match=r"not a readable \.npz"):
        load_dataset(str(tmp_path / "junk.npz"))


# ------------------------------------------------------------------------------------------------ CIFAR
def test_cifar10_and_100(tmp_path):
    ds = load_dataset(str(standins.write_cifar(tmp_path / "c10", n_train=50, n_test=20)))
    assert detect(tmp_path / "c10") == "cifar10" and ds.n_classes == 10 and ds.names[0] == "airplane"
    assert tuple(ds.train.images.shape) == (50, 3, 32, 32) and len(ds.test) == 20
    # The record layout: label byte, then 1,024 red, 1,024 green, 1,024 blue bytes.
    raw = (tmp_path / "c10" / "test_batch.bin").read_bytes()
    assert ds.test.labels[0] == raw[0]
    assert ds.test.images[0, 1, 0, 5] == raw[1 + 1024 + 5] and ds.test.images[0, 2, 31, 31] == raw[3072]
    # As the archive unpacks: the files in cifar-10-batches-bin/ below the folder given.
    standins.write_cifar(tmp_path / "unpacked" / "cifar-10-batches-bin")
    assert load_dataset(str(tmp_path / "unpacked")).n_classes == 10
    ds100 = load_dataset(str(standins.write_cifar(tmp_path / "c100", "cifar100", n_train=200)))
    raw = (tmp_path / "c100" / "train.bin").read_bytes()
    assert ds100.n_classes == 100 and ds100.train.labels[1] == raw[3074 + 1]  # the fine label, the 2nd byte
    assert ds100.names[7] == "class_007"


def test_cifar_bad(tmp_path):
    folder = standins.write_cifar(tmp_path / "t")
    batch = folder / "data_batch_3.bin"
    batch.write_bytes(batch.read_bytes()[:-100])
    with pytest.raises(DatasetError, match="not a whole number of 3073-byte CIFAR records") as e:
        load_dataset(str(folder))
    one_line(e)
    folder = standins.write_cifar(tmp_path / "r")
    raw = bytearray((folder / "test_batch.bin").read_bytes())
    raw[0] = 10
    (folder / "test_batch.bin").write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="label 10 is out of range"):
        load_dataset(str(folder))
    folder = standins.write_cifar(tmp_path / "m")
    (folder / "data_batch_5.bin").unlink()
    with pytest.raises(DatasetError, match=r"training batches missing: data_batch_5\.bin"):
        load_dataset(str(folder))


def test_pickled_cifar_is_refused_unopened(tmp_path, monkeypatch):
    py = tmp_path / "cifar-10-batches-py"
    py.mkdir()
    for name in ("data_batch_1", "test_batch", "batches.meta"):
        (py / name).write_bytes(pickle.dumps({"data": [1, 2, 3]}, protocol=2))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    for path in (tmp_path, py):
        with pytest.raises(DatasetError, match="python version' is refused") as e:
            load_dataset(str(path))
        one_line(e)


def test_archive_extraction_is_flat_and_selective(tmp_path):
    import io
    import tarfile

    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (
            ("cifar-10-batches-bin/test_batch.bin", b"x" * 10),
            ("../evil.bin", b"no"),
            ("cifar-10-batches-bin/readme.html", b"skip"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    out.mkdir()
    extract_members(archive, out, ["test_batch.bin"])
    assert sorted(p.name for p in out.iterdir()) == ["test_batch.bin"] and not (tmp_path / "evil.bin").exists()
    with pytest.raises(DatasetError, match=r"lacks data_batch_1\.bin"):
        extract_members(archive, out, ["data_batch_1.bin"])


# ------------------------------------------------------------------------------------------------ SVHN
def test_svhn(tmp_path):
    pytest.importorskip("scipy")
    from scipy.io import loadmat, savemat

    folder = standins.write_svhn(tmp_path / "s", n_train=30, n_test=20)
    ds = load_dataset(str(folder))
    assert detect(folder) == "svhn" and ds.n_classes == 10 and tuple(ds.train.images.shape) == (30, 3, 32, 32)
    mat = loadmat(str(folder / "test_32x32.mat"))
    y = mat["y"][:, 0]
    assert (y == 10).any() and (ds.test.labels.numpy() == np.where(y == 10, 0, y)).all()  # 10 is the digit 0
    np.testing.assert_array_equal(ds.test.images[3].numpy(), mat["X"][:, :, :, 3].transpose(2, 0, 1))
    savemat(str(folder / "test_32x32.mat"), {"X": mat["X"], "y": np.full_like(mat["y"], 11)})
    with pytest.raises(DatasetError, match="label 11 is out of range"):
        load_dataset(str(folder))
    (folder / "test_32x32.mat").write_bytes(b"MATLAB 5.0 MAT-file" + b" " * 97 + b"\x00" * 12 + b"\x0e\x00")
    with pytest.raises(DatasetError, match=r"corrupt or truncated \.mat") as e:
        load_dataset(str(folder))
    one_line(e)
    (folder / "test_32x32.mat").write_bytes(b"not a mat file")
    with pytest.raises(DatasetError, match=r"not a MATLAB v5 \.mat file"):
        load_dataset(str(folder))


def test_svhn_without_scipy_names_the_extra(tmp_path, monkeypatch):
    pytest.importorskip("scipy")
    import builtins

    folder = standins.write_svhn(tmp_path / "s", n_train=10, n_test=10)
    real_import = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name.startswith("scipy"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_scipy)
    with pytest.raises(DatasetError, match=r"needs scipy: pip install 'capsnet\[mat\]'"):
        load_dataset(str(folder))


# ------------------------------------------------------------------------------------------------ smallNORB
@pytest.mark.parametrize("gz", [True, False])
def test_smallnorb(tmp_path, gz):
    folder = standins.write_smallnorb(tmp_path / "n", n_train=12, n_test=10, gz=gz)
    ds = load_dataset(str(folder))
    assert detect(folder) == "smallnorb" and ds.n_classes == 5 and ds.names[2] == "airplane"
    assert tuple(ds.train.images.shape) == (12, 2, 48, 48)  # the stereo pair as 2 channels, 96 -> 48
    dat = read_matrix(next(folder.glob("*testing-dat*")))
    assert dat.shape == (10, 2, 96, 96)
    block = dat[4, 1, 10:12, 20:22].astype(float).mean()  # 2x2 block average
    assert abs(float(ds.test.images[4, 1, 5, 10]) - block) <= 0.5
    cat = read_matrix(next(folder.glob("*testing-cat*")))
    assert cat.dtype == np.int32 and (ds.test.labels.numpy() == cat).all()


def test_smallnorb_bad(tmp_path):
    folder = standins.write_smallnorb(tmp_path / "n", n_train=6, n_test=6, gz=False)
    dat = folder / f"{PREFIX['test']}-dat.mat"
    raw = dat.read_bytes()
    dat.write_bytes(b"\x00\x00\x00\x00" + raw[4:])
    with pytest.raises(DatasetError, match="not a smallNORB binary matrix") as e:
        load_dataset(str(folder))
    one_line(e)
    dat.write_bytes(raw[:-7])
    with pytest.raises(DatasetError, match="truncated: header says 6×2×96×96"):
        load_dataset(str(folder))
    dat.write_bytes(raw)
    cat = folder / f"{PREFIX['test']}-cat.mat"
    cat.write_bytes(standins.matrix_bytes(np.zeros(5, np.int32)))
    with pytest.raises(DatasetError, match=r"holds 6 pairs but .* 5 labels"):
        load_dataset(str(folder))
    cat.write_bytes(standins.matrix_bytes(np.array([0, 1, 2, 3, 4, 5], np.int32)))
    with pytest.raises(DatasetError, match="label 5 is out of range"):
        load_dataset(str(folder))
    (folder / f"{PREFIX['train']}-dat.mat").write_bytes(gzip.compress(b"x" * 100)[:-9])
    with pytest.raises(DatasetError, match="corrupt or truncated gzip"):
        load_dataset(str(folder))


# ------------------------------------------------------------------------------------------------ image folders
def test_image_folder_layouts(tmp_path):
    pytest.importorskip("PIL")
    ds = load_dataset(str(standins.write_image_folder(tmp_path / "a", per_class=6)))
    assert ds.names == ("cat", "dog", "fox") and tuple(ds.train.images.shape) == (18, 3, 20, 24)
    assert ds.train.labels.bincount().tolist() == [6, 6, 6] and len(ds.test) == 9
    assert ds.val is None
    one = standins.write_image_folder(tmp_path / "b", per_class=10, split=False)
    ds = load_dataset(str(one), test_fraction=0.2, seed=3)
    assert len(ds.train) == 24 and ds.test.labels.bincount().tolist() == [2, 2, 2]  # stratified
    again = load_dataset(str(one), test_fraction=0.2, seed=3)
    assert (again.test.images == ds.test.images).all()  # the fixed seed gives the same split
    with pytest.warns(DeprecationWarning, match="use test_fraction="):  # the old name of the option
        old = load_dataset(str(one), val_fraction=0.2, seed=3)
    assert (old.test.images == ds.test.images).all()
    (tmp_path / "c" / "train").mkdir(parents=True)
    (tmp_path / "a" / "train").rename(tmp_path / "c" / "train")
    (tmp_path / "a" / "test").rename(tmp_path / "c" / "val")
    ds = load_dataset(str(tmp_path / "c"))
    assert len(ds.test) == 9 and ds.val is None  # val/ alone beside train/ is the test split
    standins.write_image_folder(tmp_path / "d", per_class=4)
    (tmp_path / "c" / "val").rename(tmp_path / "c" / "test")
    (tmp_path / "d" / "test").rename(tmp_path / "c" / "val")  # train/, val/ and test/: an official validation split
    ds = load_dataset(str(tmp_path / "c"))
    assert len(ds.train) == 18 and len(ds.test) == 9
    assert len(ds.val) == 6 and ds.val.labels.tolist() == [0, 0, 1, 1, 2, 2]


def test_image_folder_mixed_sizes_and_modes(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    root = standins.write_image_folder(tmp_path / "m", per_class=4, size=(20, 24), mode="RGB")
    Image.new("L", (50, 40), 200).save(root / "train" / "cat" / "big_grey.jpg")
    Image.new("RGBA", (8, 8), (255, 0, 0, 128)).save(root / "train" / "dog" / "small.webp")
    ds = load_dataset(str(root))
    assert tuple(ds.train.images.shape[1:]) == (3, 20, 24)  # the most common size and mode
    grey = load_dataset(str(root), image_size="16x12", channels=1)
    assert tuple(grey.train.images.shape) == (14, 1, 16, 12)
    cat = grey.train.images[grey.train.labels == 0]
    assert (cat == 200).all(dim=(1, 2, 3)).sum() == 1  # the grey 50x40 file, resized and kept grey


def test_image_folder_bad(tmp_path):
    pytest.importorskip("PIL")
    root = standins.write_image_folder(tmp_path / "e", per_class=3)
    (root / "train" / "owl").mkdir()
    (root / "train" / "owl" / "notes.txt").write_text("not an image")
    with pytest.raises(DatasetError, match="owl: class folder with no images") as e:
        load_dataset(str(root))
    one_line(e)
    solo = standins.write_image_folder(tmp_path / "s", classes=("only",), per_class=3)
    with pytest.raises(DatasetError, match="only one class folder"):
        load_dataset(str(solo))
    stray = standins.write_image_folder(tmp_path / "x", per_class=4)
    (stray / "test" / "cow").mkdir()
    (stray / "test" / "cat" / "cat_000.png").rename(stray / "test" / "cow" / "cow_000.png")
    with pytest.raises(DatasetError, match="class 'cow' has no training folder"):
        load_dataset(str(stray))
    with pytest.raises(DatasetError, match="expected H or HxW"):
        load_dataset(str(stray), image_size="big")


def test_unreadable_files_are_skipped_with_one_warning(tmp_path, capsys):
    pytest.importorskip("PIL")
    root = standins.write_image_folder(tmp_path / "u", per_class=4)
    good = (root / "train" / "cat" / "cat_000.png").read_bytes()
    (root / "train" / "cat" / "empty.png").write_bytes(b"")
    (root / "train" / "dog" / "truncated.png").write_bytes(good[: len(good) // 2])
    (root / "train" / "fox" / "text.jpg").write_text("hello")
    ds = load_dataset(str(root))
    assert len(ds.train) == 12
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 3 unreadable image file(s)" in err[0] and "empty.png" in err[0]
    with pytest.raises(DatasetError, match="3 unreadable image file"):
        load_dataset(str(root), strict=True)
    for p in (root / "train" / "dog").iterdir():
        (p.unlink() if p.name != "truncated.png" else None)
    with pytest.raises(DatasetError, match="class 'dog' has no readable training image"):
        load_dataset(str(root))


def test_image_folder_cache_reused_and_invalidated(tmp_path, monkeypatch):
    Image = pytest.importorskip("PIL.Image")
    root = standins.write_image_folder(tmp_path / "c", per_class=4)
    first = load_dataset(str(root))
    assert list((tmp_path / "cache" / "folders").glob("c-*/images.npy"))
    real = folder_mod._decode
    monkeypatch.setattr(folder_mod, "_decode", lambda *a: pytest.fail("decoded again"))
    second = load_dataset(str(root))  # from the .npy cache: nothing decoded
    assert (second.train.images == first.train.images).all()
    monkeypatch.setattr(folder_mod, "_decode", real)
    path = root / "train" / "dog" / "dog_001.png"
    Image.new("RGB", (24, 20), (255, 255, 255)).save(path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    white = lambda ds: int((ds.train.images == 255).flatten(1).all(dim=1).sum())  # noqa: E731
    assert white(first) == 0 and white(load_dataset(str(root))) == 1  # the changed file was read afresh


def test_image_folder_memory_maps_large_sets(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    root = standins.write_image_folder(tmp_path / "big", per_class=4)
    small = load_dataset(str(root))
    monkeypatch.setattr(folder_mod, "MMAP_BYTES", 100)
    modes, real_load = [], np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: modes.append(k.get("mmap_mode")) or real_load(*a, **k))
    ds = load_dataset(str(root))
    assert "c" in modes and (ds.train.images == small.train.images).all()


def test_pillow_missing_is_one_clear_line(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    import builtins

    root = standins.write_image_folder(tmp_path / "p", per_class=2)
    real_import = builtins.__import__

    def no_pil(name, *args, **kwargs):
        if name == "PIL" or name.startswith("PIL."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pil)
    with pytest.raises(CapsNetError, match=r"needs Pillow: pip install 'capsnet\[images\]'"):
        load_dataset(str(root))


def test_nothing_recognisable(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(DatasetError, match="no data set found here") as e:
        load_dataset(str(tmp_path))
    one_line(e)
    with pytest.raises(DatasetError, match=r"not a \.npz"):
        load_dataset(str(tmp_path / "readme.txt"))


# ------------------------------------------------------------------------------------------------ known names
@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """(base URL, served folder, requested paths) of a local HTTP server; retries without waiting."""
    import functools
    import http.server
    import threading

    from capsnet.data import download as dl

    monkeypatch.setattr(dl, "RETRY_BACKOFF_S", 0.0)
    monkeypatch.delenv("CAPSNET_MIRRORS", raising=False)
    root, requests = tmp_path / "mirror", []
    root.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", root, requests
    finally:
        server.shutdown()
        server.server_close()


def test_cifar10_and_smallnorb_download_by_name(mirror, monkeypatch, tmp_path):
    import hashlib
    import tarfile

    from capsnet.data import DATASETS

    url, root, requests = mirror
    folder = standins.write_cifar(tmp_path / "src" / "cifar-10-batches-bin")
    with tarfile.open(root / "cifar-10-binary.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-bin")
    md5 = hashlib.md5((root / "cifar-10-binary.tar.gz").read_bytes()).hexdigest()
    monkeypatch.setitem(DATASETS["cifar10"]["files"], "cifar-10-binary.tar.gz", md5)
    ds = load_dataset("cifar10", mirrors=[url])
    cached = tmp_path / "cache" / "cifar10"
    assert ds.name == "cifar10" and ds.kind == "cifar10" and len(ds.train) == 50
    assert not (cached / "cifar-10-binary.tar.gz").exists() and (cached / "test_batch.bin").is_file()
    load_dataset("cifar10", download=False)
    assert requests == ["/cifar-10-binary.tar.gz"]  # once: then from the cache
    norb = standins.write_smallnorb(root, n_train=4, n_test=4)
    for name in DATASETS["smallnorb"]["files"]:
        monkeypatch.setitem(DATASETS["smallnorb"]["files"], name, hashlib.md5((norb / name).read_bytes()).hexdigest())
    assert load_dataset("smallnorb", mirrors=[url]).n_classes == 5
    monkeypatch.setitem(DATASETS["svhn"]["files"], "test_32x32.mat", "0" * 32)
    with pytest.raises(DatasetError, match="could not download svhn") as e:
        load_dataset("svhn", mirrors=[url])
    one_line(e)


@pytest.mark.parametrize("error", [RuntimeError("a decoder crash"), KeyboardInterrupt()])
def test_image_folder_cache_leaves_no_temporary_file_on_an_error(tmp_path, monkeypatch, error):
    pytest.importorskip("PIL")
    root = standins.write_image_folder(tmp_path / "t", per_class=4)
    real, calls = folder_mod._decode, []

    def decode(*args):
        calls.append(1)
        if len(calls) == 5:
            raise error
        if len(calls) > 5:
            time.sleep(0.1)  # (the ones after the failure are slow: the cancel comes first)
        return real(*args)

    monkeypatch.setattr(folder_mod, "_decode", decode)
    with pytest.raises(type(error)):
        load_dataset(str(root), workers=1)
    (entry,) = (tmp_path / "cache" / "folders").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == []  # neither the temporary .images.<pid>.npy nor a partial entry
    assert len(calls) < 27  # the files after the failure were cancelled (but those already started)
    monkeypatch.setattr(folder_mod, "_decode", real)
    assert len(load_dataset(str(root)).train) == 12  # and the next load builds the entry


@pytest.mark.parametrize(
    "damage",
    ["images.npy missing", "ok.npy missing", "images.npy truncated", "images.npy wrong shape", "meta.json not JSON"],
)
def test_image_folder_cache_hit_is_checked_and_rebuilt(tmp_path, monkeypatch, damage):
    pytest.importorskip("PIL")
    root = standins.write_image_folder(tmp_path / "h", per_class=4)
    first = load_dataset(str(root))
    (entry,) = (tmp_path / "cache" / "folders").iterdir()
    name, what = damage.split(" ", 1)
    path = entry / name
    if what == "missing":
        path.unlink()
    elif what == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif what == "wrong shape":
        np.save(path, np.zeros((5, 3, 20, 24), np.uint8))
    else:
        path.write_text("{")
    again = load_dataset(str(root))  # rebuilt, not a traceback
    assert torch.equal(again.train.images, first.train.images) and torch.equal(again.test.labels, first.test.labels)
    assert sorted(p.name for p in entry.iterdir()) == ["images.npy", "meta.json", "ok.npy"]
    monkeypatch.setattr(folder_mod, "_decode", lambda *a: pytest.fail("decoded again"))
    assert torch.equal(load_dataset(str(root)).train.images, first.train.images)  # the rebuilt entry is a hit


def test_fashion_mnist_is_not_a_digit_set_and_names_its_classes(tmp_path):
    from helpers import write_digits

    from capsnet.training.classification import ClassificationTask
    from capsnet.training.config import TrainConfig

    fashion = load_dataset(str(write_digits(tmp_path / "fashion-mnist", 20)))  # a folder of the set's own name
    assert not fashion.digits and fashion.names[0] == "T-shirt/top" and fashion.names[9] == "Ankle boot"
    assert load_dataset(str(write_digits(tmp_path / "my-digits", 20))).digits  # any other IDX folder: digits
    task = ClassificationTask.from_config(TrainConfig(dataset=str(tmp_path / "fashion-mnist"), augment="shift=2,flip"))
    assert task.spec.flip and task.model_fields()["class_names"][1] == "Trouser"  # flips are allowed
