"""MNIST's IDX file format: decoding with a check of every part of the structure."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from .arrays import read_bytes
from .download import FILE_NAMES
from .split import Dataset, Split

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"); data is big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Decode an IDX file (raw or gzipped) into an array, checking every part of its structure."""
    path = Path(path)
    raw = read_bytes(path)  # gunzipped if gzip (by content, not by the file name)
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


def load_idx_folder(folder: Path, *, name: str, source: str) -> Dataset:
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
    return Dataset(name=name, source=source, train=train, test=test, n_classes=max(10, top + 1), digits=True)
