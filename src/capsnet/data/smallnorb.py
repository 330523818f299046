"""smallNORB (https://cs.nyu.edu/~ylclab/data/norb-v1.0-small/): NYU's binary matrix files.

A set is three files per split, e.g. `smallnorb-5x46789x9x18x6x2x96x96-training-{dat,cat,info}.mat` (and
`smallnorb-5x01235x9x18x6x2x96x96-testing-*`), each optionally gzipped:
  dat   ubyte [N, 2, 96, 96]  the stereo pair, here the 2 input channels
  cat   int32 [N]             the category 0..4: animal, human, airplane, truck, car
  info  int32 [N, 4]          instance, elevation, azimuth, lighting (checked, not used for classification)

A binary matrix is: magic (int32, little-endian; 0x1E3D4C55 ubyte, 0x1E3D4C54 int32, ...), ndim (int32), then
max(3, ndim) int32 dimensions (unused ones are 1), then the data, little-endian, row-major.

The images are downsampled to 48×48 as the capsule paper's official code does (it resizes smallNORB to 48×48 and
then crops 32×32 patches); here by averaging 2×2 blocks. Other sides (`size`): a divisor of 96 by averaging
blocks likewise, any other by half-pixel bilinear interpolation without antialiasing, as TensorFlow's
`tf.image.resize` (the Efficient-CapsNet code's 96 → 64), rounded back to uint8. A resized split carries the
per-channel mean and std of its 96×96 originals (`Split.channel_stats`), the statistics that code standardizes with.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from .arrays import finish, make_split, read_bytes
from .split import Dataset, Split

MAGIC: dict[int, np.dtype] = {
    0x1E3D4C55: np.dtype("<u1"),
    0x1E3D4C54: np.dtype("<i4"),
    0x1E3D4C51: np.dtype("<f4"),
    0x1E3D4C53: np.dtype("<f8"),
    0x1E3D4C56: np.dtype("<i2"),
}
PREFIX = {"train": "smallnorb-5x46789x9x18x6x2x96x96-training", "test": "smallnorb-5x01235x9x18x6x2x96x96-testing"}
CLASS_NAMES = ("animal", "human", "airplane", "truck", "car")
SIZE = 48


def read_matrix(path: str | os.PathLike) -> np.ndarray:
    """Decode one NYU binary matrix file (raw or gzipped), checking its magic number, header and length."""
    path = Path(path)
    raw = read_bytes(path)
    if len(raw) < 8:
        raise DatasetError(f"{path}: too short to be a smallNORB binary matrix ({len(raw)} bytes)")
    magic, ndim = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=2))
    if magic not in MAGIC:
        raise DatasetError(f"{path}: not a smallNORB binary matrix (magic number 0x{magic & 0xFFFFFFFF:08X})")
    if not 1 <= ndim <= 16:
        raise DatasetError(f"{path}: header declares {ndim} dimensions")
    stored = max(3, ndim)
    header = 8 + 4 * stored
    if len(raw) < header:
        raise DatasetError(f"{path}: truncated header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype="<i4", count=ndim, offset=8))
    if min(dims) < 0:
        raise DatasetError(f"{path}: negative dimension in header {dims}")
    dtype = MAGIC[magic]
    expected, found = math.prod(dims) * dtype.itemsize, len(raw) - header
    if found != expected:
        what = "truncated" if found < expected else "has trailing bytes"
        raise DatasetError(f"{path}: {what}: header says {'×'.join(map(str, dims))} = {expected} bytes, found {found}")
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def find(folder: Path, split: str, part: str) -> Path | None:
    for suffix in (".mat", ".mat.gz"):
        p = folder / f"{PREFIX[split]}-{part}{suffix}"
        if p.is_file():
            return p
    return None


def detect(folder: Path) -> bool:
    return any(find(folder, s, "dat") for s in PREFIX)


def downsample(images: np.ndarray, size: int = SIZE) -> np.ndarray:
    """uint8 [N, C, H, W] -> [N, C, size, size] by averaging (H/size)×(W/size) blocks (H, W multiples of size),
    or else by `resize_bilinear`."""
    n, c, h, w = images.shape
    if (h, w) == (size, size):
        return images
    if h % size or w % size:
        return resize_bilinear(images, size)
    fh, fw = h // size, w // size
    blocks = images.reshape(n, c, size, fh, size, fw).astype(np.uint16)
    return ((blocks.sum(axis=(3, 5)) + (fh * fw) // 2) // (fh * fw)).astype(np.uint8)


def resize_bilinear(images: np.ndarray, size: int, *, chunk: int = 512) -> np.ndarray:
    """uint8 [N, C, H, W] -> [N, C, size, size]: half-pixel bilinear interpolation without antialiasing (source
    coordinate (i + ½)·H/size − ½, clamped at the edges; tf.image.resize's bilinear default), rounded to uint8."""
    out = np.empty((*images.shape[:2], size, size), dtype=np.uint8)
    for start in range(0, len(images), chunk):
        x = torch.tensor(images[start : start + chunk], dtype=torch.float32)  # (a copy: the bytes are read-only)
        y = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        out[start : start + chunk] = y.round_().clamp_(0, 255).to(torch.uint8).numpy()
    return out


def pixel_stats(images: np.ndarray, *, chunk: int = 1024) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std of uint8 images [N, C, H, W], in float64."""
    c = images.shape[1]
    total, squares = np.zeros(c), np.zeros(c)
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk].astype(np.float64)
        total += x.sum(axis=(0, 2, 3))
        squares += np.square(x).sum(axis=(0, 2, 3))
    n = max(1, images.shape[0] * images.shape[2] * images.shape[3])
    mean = total / n
    std = np.sqrt(np.maximum(squares / n - mean * mean, 0.0))
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def read_split(dat: Path, cat: Path, info: Path | None = None, *, size: int = SIZE) -> Split:
    """One split: images uint8 [N, 2, size, size], categories [N]; lengths of dat, cat (and info) must agree."""
    images, labels = read_matrix(dat), read_matrix(cat)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise DatasetError(f"{dat}: expected ubyte images [N, 2, H, W], got {images.dtype} {list(images.shape)}")
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise DatasetError(f"{cat}: expected an int32 category vector [N], got {labels.dtype} {list(labels.shape)}")
    if len(images) != len(labels):
        raise DatasetError(f"{dat.parent}: {dat.name} holds {len(images)} pairs but {cat.name} {len(labels)} labels")
    if info is not None:
        meta = read_matrix(info)
        if meta.ndim != 2 or len(meta) != len(labels):
            raise DatasetError(f"{info}: expected [{len(labels)}, 4] info rows, got {list(meta.shape)}")
    split = make_split(downsample(images, size), labels, str(dat))
    if size == images.shape[-1] or not len(images):
        return split
    return dataclasses.replace(split, channel_stats=pixel_stats(images))


def load_smallnorb(folder: Path, *, size: int = SIZE, name: str | None = None, source: str | None = None) -> Dataset:
    splits: dict[str, Split | None] = {}
    for split in ("train", "test"):
        dat, cat = find(folder, split, "dat"), find(folder, split, "cat")
        if dat is None and cat is None:
            splits[split] = None
            continue
        if dat is None or cat is None:
            have, lack = ("dat", "cat") if cat is None else ("cat", "dat")
            raise DatasetError(f"{folder}: has {PREFIX[split]}-{have}.mat but not its -{lack}.mat[.gz]")
        splits[split] = read_split(dat, cat, find(folder, split, "info"), size=size)
    if splits["test"] is None:
        raise DatasetError(f"{folder}: no {PREFIX['test']}-dat/-cat files (every data set needs a test split)")
    return finish(
        name=name or "smallnorb",
        source=source or str(folder),
        train=splits["train"],
        test=splits["test"],
        n_classes=5,
        class_names=CLASS_NAMES,
        where=str(folder),
    )
