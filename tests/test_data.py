"""IDX decoding, data set resolution, batching and the `capsnet data` command (no network)."""

from __future__ import annotations

import gzip
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from capsnet import cli
from capsnet.data import Dataset, Split, iterate_batches, load_dataset, num_batches, read_idx
from capsnet.data.batching import shard_indices
from capsnet.errors import DatasetError
from capsnet.pixels import to_float

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "capsnet" / "data_files" / "mnist-sample"
NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    return struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def write_set(folder: Path, *, n_train: int = 12, n_test: int = 7, gz: bool = True, test_only: bool = False):
    """A tiny MNIST-format folder; labels cycle 0..9."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    splits = [("t10k", n_test)] if test_only else [("train", n_train), ("t10k", n_test)]
    for split, n in splits:
        imgs = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        for kind, arr in (("images-idx3", imgs), ("labels-idx1", labels)):
            data = idx_bytes(arr)
            name = f"{split}-{kind}-ubyte"
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
    return folder


# ---------------------------------------------------------------- read_idx


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_good(tmp_path, gz):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    p = tmp_path / ("x.gz" if gz else "x")
    p.write_bytes(gzip.compress(idx_bytes(arr)) if gz else idx_bytes(arr))
    out = read_idx(p)
    assert out.dtype == np.uint8 and out.flags.writeable
    np.testing.assert_array_equal(out, arr)


def test_read_idx_other_dtype(tmp_path):
    arr = np.array([1, -2, 300], dtype=">i4")
    (tmp_path / "x").write_bytes(idx_bytes(arr, code=0x0C))
    np.testing.assert_array_equal(read_idx(tmp_path / "x"), [1, -2, 300])


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (lambda good: good[:-5], "truncated"),
        (lambda good: good + b"\0", "trailing bytes"),
        (lambda good: b"\x01\x02" + good[2:], "not an IDX file"),
        (lambda good: good[:2] + b"\x42" + good[3:], "data type code"),
        (lambda good: good[:3] + b"\x05" + good[4:], "header says 3×4×4×0×0"),  # 5 dims declared, 3 given
        (lambda good: good[:3] + b"\x00" + good[4:], "0 dimensions"),
        (lambda good: gzip.compress(good)[:-12], "gzip"),
        (lambda good: gzip.compress(good)[:10] + b"garbage" * 5, "gzip"),
        (lambda good: b"\0\0", "too short"),
    ],
)
def test_read_idx_broken(tmp_path, content, problem):
    good = idx_bytes(np.zeros((3, 4, 4), dtype=np.uint8))
    p = tmp_path / "bad-images-idx3-ubyte"
    p.write_bytes(content(good))
    with pytest.raises(DatasetError, match=problem) as e:
        read_idx(p)
    assert str(p) in str(e.value)


def test_read_idx_missing(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read_idx(tmp_path / "nope")


def test_count_mismatch(tmp_path):
    folder = write_set(tmp_path / "s")
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(6, np.uint8))))
    with pytest.raises(DatasetError, match=r"7 images but .* 6 labels"):
        load_dataset(str(folder))


def test_wrong_dimensions(tmp_path):
    folder = write_set(tmp_path / "s")
    (folder / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros((12, 784), np.uint8))))
    with pytest.raises(DatasetError, match="N×H×W"):
        load_dataset(str(folder))


# ---------------------------------------------------------------- resolution


def test_bundled_sample():
    t0 = time.perf_counter()
    ds = load_dataset("mnist-sample")
    assert time.perf_counter() - t0 < 1.0
    assert isinstance(ds, Dataset) and ds.source == "bundled" and ds.n_classes == 10
    assert len(ds.train) == 6000 and len(ds.test) == 2000
    assert ds.train.images.shape == (6000, 1, 28, 28) and ds.train.images.dtype == torch.uint8
    assert ds.test.images.shape == (2000, 1, 28, 28) and ds.test.labels.dtype == torch.int64
    assert ds.train.labels.bincount().tolist() == [605, 690, 555, 615, 588, 529, 594, 658, 588, 578]
    assert set(ds.test.labels.tolist()) == set(range(10))
    assert load_dataset() is ds  # loaded once per process


def test_folder_beats_name(tmp_path, monkeypatch):
    folder = write_set(tmp_path / "mnist-sample", gz=False)
    monkeypatch.chdir(tmp_path)
    ds = load_dataset("mnist-sample")  # an existing folder of that name wins over the bundled set
    assert len(ds.train) == 12 and ds.source == "mnist-sample"
    ds2 = load_dataset("kmnist", data_dir=str(folder), download=False)  # data_dir wins over everything
    assert ds2.name == "kmnist" and len(ds2.test) == 7


def test_test_only_folder(tmp_path):
    ds = load_dataset(str(write_set(tmp_path / "t", test_only=True)))
    assert ds.train is None and len(ds.test) == 7


def test_folder_errors(tmp_path):
    with pytest.raises(DatasetError, match="no data set found here: expected MNIST IDX files"):
        load_dataset(str(tmp_path))
    folder = write_set(tmp_path / "s")
    (folder / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match="has train-images-idx3-ubyte but not train-labels"):
        load_dataset(str(folder))
    with pytest.raises(DatasetError, match="known: mnist-sample, mnist, fashion-mnist, kmnist"):
        load_dataset("cifar-10")
    with pytest.raises(DatasetError, match="no such folder"):
        load_dataset("mnist", data_dir=str(tmp_path / "missing"))
    with pytest.raises(DatasetError, match="is a file"):
        load_dataset(str(folder / "t10k-images-idx3-ubyte.gz"))


def test_edited_folder_is_reloaded(tmp_path):
    folder = write_set(tmp_path / "s")
    assert len(load_dataset(str(folder)).train) == 12
    shutil.rmtree(folder)
    write_set(folder, n_train=20)
    assert len(load_dataset(str(folder)).train) == 20


def test_known_name_offline_without_download(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))
    with pytest.raises(DatasetError) as e:
        load_dataset("kmnist", download=False)
    msg = str(e.value)
    assert str(tmp_path / "cache" / "kmnist") in msg and "t10k-labels-idx1-ubyte.gz" in msg
    assert "--data-dir" in msg


def test_known_name_from_cache(tmp_path, monkeypatch):
    write_set(tmp_path / "kmnist")
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path))
    ds = load_dataset("kmnist", download=False)
    assert ds.name == "kmnist" and len(ds.train) == 12


# ---------------------------------------------------------------- batching


def toy_split(n: int = 23) -> Split:
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    return Split(images=images, labels=torch.arange(n))


def labels_of(split, **kw):
    return torch.cat([y for _, y in iterate_batches(split, **kw)]).tolist()


def test_batches_cover_every_index_once():
    split = toy_split()
    batches = list(iterate_batches(split, batch_size=5, shuffle=True, seed=3))
    assert len(batches) == num_batches(23, batch_size=5) == 5
    x, y = batches[0]
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (5, 1, 2, 2)
    assert all(float(b[0].min()) >= 0 and float(b[0].max()) <= 1 for b in batches)
    assert torch.allclose(x[:, 0, 0, 0] * 255, y.float())  # images travel with their labels
    seen = labels_of(split, batch_size=5, shuffle=True, seed=3)
    assert sorted(seen) == list(range(23)) and seen != list(range(23))
    assert labels_of(split, batch_size=5) == list(range(23))  # no shuffle: in order


def test_shuffle_reproducible_and_per_epoch():
    split = toy_split()
    a = labels_of(split, batch_size=4, shuffle=True, seed=1, epoch=0)
    assert a == labels_of(split, batch_size=4, shuffle=True, seed=1, epoch=0)
    assert a != labels_of(split, batch_size=4, shuffle=True, seed=1, epoch=1)
    assert a != labels_of(split, batch_size=4, shuffle=True, seed=2, epoch=0)


@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_shards(drop_last):
    split, ws = toy_split(23), 3
    shards = [
        labels_of(split, batch_size=3, shuffle=True, seed=5, rank=r, world_size=ws, drop_last=drop_last)
        for r in range(ws)
    ]
    n_b = num_batches(23, batch_size=3, world_size=ws, drop_last=drop_last)
    for r in range(ws):
        assert len(list(iterate_batches(split, batch_size=3, rank=r, world_size=ws, drop_last=drop_last))) == n_b
    if drop_last:
        assert all(len(s) == 6 for s in shards)  # 23 // 3 = 7 per rank, then whole batches of 3
        flat = [i for s in shards for i in s]
        assert len(set(flat)) == len(flat)  # disjoint
    else:
        assert all(len(s) == 8 for s in shards)  # ceil(23 / 3), padded by wrapping
        assert {i for s in shards for i in s} == set(range(23))
        unique = [set(s) for s in shards]
        overlap = sum(len(unique[i] & unique[j]) for i in range(ws) for j in range(i + 1, ws))
        assert overlap <= 1  # only the single wrapped example repeats


def test_batch_arg_errors():
    with pytest.raises(ValueError):
        iterate_batches(toy_split(), batch_size=0)
    with pytest.raises(ValueError):
        iterate_batches(toy_split(), batch_size=2, rank=2, world_size=2)
    assert list(iterate_batches(toy_split(0), batch_size=4)) == []


# ---------------------------------------------------------------- CLI


@pytest.fixture
def run_cli(monkeypatch):
    # Only the data subcommand: other subcommands' modules may not exist yet in a partial tree.
    monkeypatch.setattr(cli, "COMMANDS", [("data", "capsnet.cli.data")])
    return cli.main


def test_cli_info(run_cli, capsys):
    assert run_cli(["data", "info", "mnist-sample"]) == 0
    out = capsys.readouterr().out
    assert "6000" in out and "2000" in out and "1×28×28" in out
    assert "605" in out and "690" in out


def test_cli_info_shows_each_files_md5(run_cli, capsys):
    from capsnet.data.download import BUNDLED_MD5

    assert run_cli(["data", "info", "mnist-sample"]) == 0
    lines = capsys.readouterr().out.splitlines()
    md5s = {line.split()[1]: line.split()[0] for line in lines if line.startswith("  ") and len(line.split()) == 2}
    assert {name.removesuffix(".gz"): md5 for name, md5 in BUNDLED_MD5.items()} == {
        name.removesuffix(".gz"): md5 for name, md5 in md5s.items()
    }
    assert len(md5s) == 4


def test_cli_check(run_cli, capsys):
    assert run_cli(["data", "check", "mnist-sample"]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 4 and "c9b62c7fd82178c2047ad09cfb53fd28" in out


def test_cli_check_finds_problems(run_cli, capsys, tmp_path):
    folder = write_set(tmp_path / "s")
    (folder / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    assert run_cli(["data", "check", str(folder)]) == 2  # bad input: exit status 2, as the README says
    captured = capsys.readouterr()
    assert "FAIL  train-images-idx3-ubyte.gz" in captured.out and "gzip" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("capsnet data: error: problems found")


def test_cli_check_md5_mismatch_of_known_set(run_cli, capsys, tmp_path, monkeypatch):
    write_set(tmp_path / "mnist")
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path))
    assert run_cli(["data", "check", "mnist"]) == 2
    assert "is not the known one" in capsys.readouterr().out


@pytest.mark.parametrize("action", ["info", "check"])
def test_cli_bad_input_one_line(run_cli, capsys, tmp_path, action):
    folder = write_set(tmp_path / "s")
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    target = str(folder) if action == "info" else str(tmp_path / "missing")
    assert run_cli(["data", action, target]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("capsnet data: error:")


def test_shard_indices_wraps_or_drops():
    order = torch.tensor([10, 11, 12, 13, 14])
    assert [shard_indices(order, rank=r, world_size=2).tolist() for r in range(2)] == [[10, 12, 14], [11, 13, 10]]
    dropped = [shard_indices(order, rank=r, world_size=2, drop_last=True).tolist() for r in range(2)]
    assert dropped == [[10, 12], [11, 13]]
    assert shard_indices(order, rank=0, world_size=1).tolist() == order.tolist()
    # more ranks than indices: the order wraps more than once
    assert [shard_indices(order[:2], rank=r, world_size=5).tolist() for r in range(5)] == [[10], [11], [10], [11], [10]]


def test_to_float():
    u8 = torch.tensor([0, 51, 255], dtype=torch.uint8)
    x = to_float(u8)
    assert x.dtype == torch.float32 and torch.equal(x, torch.tensor([0.0, 0.2, 1.0]))
    assert u8.tolist() == [0, 51, 255]  # the input is left alone
    f = torch.tensor([0.25, 1.0], dtype=torch.float64)
    assert to_float(f).dtype == torch.float32 and to_float(f).tolist() == [0.25, 1.0]  # floats are not rescaled
