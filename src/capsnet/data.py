"""MNIST-format data sets: IDX decoding, locating / downloading sets, and batching.

A data set is a folder holding `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
`t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte` (each optionally gzipped). Sets are held in
memory as uint8 tensors and converted to float on the training device, batch by batch.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .augment import random_affine, random_shift
from .download import DATASETS, FILE_NAMES, cache_root, missing_files_message
from .download import download as _download
from .errors import DatasetError

__all__ = [
    "DATASETS",
    "Dataset",
    "Split",
    "find_files",
    "iterate_batches",
    "load_dataset",
    "num_batches",
    "random_affine",
    "random_shift",
    "read_idx",
    "resolve",
]

BUNDLED = "mnist-sample"
_BUNDLED_DIR = Path(__file__).resolve().parent / "data_files" / BUNDLED

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"); data is big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Decode an IDX file (raw or gzipped) into an array, checking every part of its structure."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    if raw[:2] == b"\x1f\x8b":  # gzip magic: decide by content, not by the file name
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DatasetError(f"{path}: corrupt or truncated gzip data ({e})") from None
    if len(raw) < 4:
        raise DatasetError(f"{path}: too short to be an IDX file ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise DatasetError(f"{path}: not an IDX file (magic number {raw[:4].hex()})")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise DatasetError(f"{path}: unknown IDX data type code 0x{code:02x}")
    if ndim == 0:
        raise DatasetError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = math.prod(dims) * dtype.itemsize
    found = len(raw) - header
    if found != expected:
        what = "truncated" if found < expected else "has trailing bytes"
        raise DatasetError(
            f"{path}: {what}: header says {'×'.join(map(str, dims))} {dtype.name} = {expected} bytes, found {found}"
        )
    # bytearray makes the array writable, so torch.from_numpy needs no copy and gives no warning.
    arr = np.frombuffer(bytearray(memoryview(raw)[header:]), dtype=dtype).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


@dataclass(frozen=True)
class Split:
    """One split in memory: uint8 images [N, C, H, W] and int64 labels [N]."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Dataset:
    name: str
    source: str  # the folder the files came from, or "bundled"
    train: Split | None  # None for a test-only folder
    test: Split
    n_classes: int = 10


def find_files(folder: Path) -> dict[str, Path]:
    """The IDX files of `folder` by base name (the uncompressed file wins: no need to gunzip it)."""
    found = {}
    for base in FILE_NAMES:
        for candidate in (folder / base, folder / f"{base}.gz"):
            if candidate.is_file():
                found[base] = candidate
                break
    return found


def _load_pair(images_path: Path, labels_path: Path) -> Split:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DatasetError(
            f"{images_path}: expected uint8 images of shape N×H×W, got {images.dtype.name} "
            f"{'×'.join(map(str, images.shape))}"
        )
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DatasetError(f"{labels_path}: expected a 1-d uint8 label vector, got shape {labels.shape}")
    if len(images) != len(labels):
        raise DatasetError(
            f"{images_path.parent}: {images_path.name} holds {len(images)} images but "
            f"{labels_path.name} holds {len(labels)} labels"
        )
    return Split(images=torch.from_numpy(images).unsqueeze(1), labels=torch.from_numpy(labels).long())


def _load_folder(folder: Path, *, name: str, source: str) -> Dataset:
    files = find_files(folder)
    pairs = {}
    for split in ("train", "t10k"):
        img, lab = f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"
        if (img in files) != (lab in files):
            have, lack = (img, lab) if img in files else (lab, img)
            raise DatasetError(f"{folder}: has {have} but not {lack}[.gz]")
        if img in files:
            pairs[split] = (files[img], files[lab])
    if "t10k" not in pairs:
        raise DatasetError(
            f"{folder}: no MNIST-format data set here; expected {', '.join(FILE_NAMES)} "
            "(each optionally .gz; the t10k pair alone makes a test-only set)"
        )
    train = _load_pair(*pairs["train"]) if "train" in pairs else None
    test = _load_pair(*pairs["t10k"])
    top = max(int(s.labels.max()) for s in (train, test) if s is not None and len(s))
    return Dataset(name=name, source=source, train=train, test=test, n_classes=max(10, top + 1))


# Loaded sets by folder, keyed with file sizes and mtimes so an edited folder is read afresh.
_CACHE: dict[tuple, Dataset] = {}


def _load_cached(folder: Path, *, name: str, source: str) -> Dataset:
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in find_files(folder).values())
    key = (str(folder.resolve()), name, source, stamp)
    if key not in _CACHE:
        _CACHE[key] = _load_folder(folder, name=name, source=source)
    return _CACHE[key]


def resolve(
    name_or_dir: str, *, data_dir: str | None = None, cache_dir: str | None = None
) -> tuple[str, Path | None, str]:
    """Where a set lives, without loading or downloading it: (name, folder or None, source).

    The folder is None for a known set that is in neither the cache nor a system folder; it would be
    downloaded into `cache_root(cache_dir) / name`.
    """
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DatasetError(f"data dir {data_dir}: no such folder")
        return (name_or_dir if name_or_dir in DATASETS else folder.name or str(folder)), folder, str(folder)
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        return path.resolve().name, path, str(path)
    if path.exists():
        raise DatasetError(f"{name_or_dir}: is a file; give the folder that holds the IDX files")
    if name_or_dir == BUNDLED:
        return BUNDLED, _BUNDLED_DIR, "bundled"
    if name_or_dir in DATASETS:
        cached = cache_root(cache_dir) / name_or_dir
        candidates = [cached, *(Path(d) for d in DATASETS[name_or_dir].get("system_dirs", []))]
        for folder in candidates:
            if len(find_files(folder)) == len(FILE_NAMES):
                return name_or_dir, folder, str(folder)
        return name_or_dir, None, str(cached)
    known = ", ".join([BUNDLED, *DATASETS])
    if os.sep in name_or_dir or "/" in name_or_dir:
        raise DatasetError(f"{name_or_dir}: no such folder (known data set names: {known})")
    raise DatasetError(f"{name_or_dir}: neither a folder nor a known data set (known: {known})")


def load_dataset(
    name_or_dir: str = BUNDLED,
    *,
    data_dir: str | None = None,
    download: bool = True,
    cache_dir: str | None = None,
    mirrors: list[str] | None = None,
) -> Dataset:
    """Load a data set: a folder (`data_dir`, or `name_or_dir` if it is one), the bundled
    "mnist-sample", or a known set ("mnist", "fashion-mnist", "kmnist") from the cache, a system
    folder or, failing those and if `download`, from its mirrors into the cache."""
    name, folder, source = resolve(name_or_dir, data_dir=data_dir, cache_dir=cache_dir)
    if folder is None:
        folder = Path(source)
        if not download:
            raise DatasetError(f"{name} is not downloaded (download disabled); " + missing_files_message(name, folder))
        _download(name, folder, mirrors=mirrors)
    return _load_cached(folder, name=name, source=source)


def num_batches(n: int, *, batch_size: int, world_size: int = 1, drop_last: bool = False) -> int:
    """How many batches `iterate_batches` yields on every rank for a split of `n` examples."""
    per_rank = n // world_size if drop_last else -(-n // world_size)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def _epoch_seed(seed: int, epoch: int) -> int:
    # SeedSequence mixes (seed, epoch) well, so neighbouring epochs get unrelated permutations.
    return int(np.random.SeedSequence([seed & (2**63 - 1), epoch & (2**63 - 1)]).generate_state(1, np.uint64)[0])


def _shard(n: int, *, shuffle: bool, seed: int, epoch: int, rank: int, world_size: int, drop_last: bool):
    if shuffle:
        g = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    if drop_last:
        order = order[: (n // world_size) * world_size]
    else:
        total = -(-n // world_size) * world_size
        if total > n:  # wrap around so every rank has the same number of examples
            order = torch.cat([order] * (-(-total // n)))[:total]
    return order[rank::world_size]


def iterate_batches(
    split: Split,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (images float32 [B, C, H, W] in [0, 1], labels int64 [B]) on `device`.

    The order is a permutation seeded by (seed, epoch): the same on every rank and every run, new
    each epoch. Rank r takes every world_size-th example; the end wraps so all ranks yield
    `num_batches(...)` batches (with drop_last, the remainder is dropped instead).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    opts = {"shuffle": shuffle, "seed": seed, "epoch": epoch, "drop_last": drop_last}
    idx = _shard(len(split), rank=rank, world_size=world_size, **opts)
    return _batches(split, idx, batch_size=batch_size, drop_last=drop_last, device=torch.device(device))


def _batches(split: Split, idx: torch.Tensor, *, batch_size: int, drop_last: bool, device: torch.device):
    stop = (len(idx) // batch_size) * batch_size if drop_last else len(idx)
    for start in range(0, stop, batch_size):
        take = idx[start : start + batch_size]
        # Move uint8 (4× smaller than float) and convert on the device.
        images = split.images[take].to(device, non_blocking=True).float().div_(255.0)
        yield images, split.labels[take].to(device, non_blocking=True)
