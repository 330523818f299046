"""Shared checks of the array readers (NumPy, CIFAR, SVHN, smallNORB): bytes in, a checked `Dataset` out."""

from __future__ import annotations

import gzip
import io
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from ..limits import MAX_ARRAY_ELEMENTS, MAX_CLASSES, MAX_EXPANSION
from .split import Dataset, Split


def read_bytes(path: str | os.PathLike) -> bytes:
    """A file's bytes, gunzipped when its content is gzip (decided by the magic number, not the name); gzip data
    that would expand past MAX_EXPANSION times its size (or MAX_ARRAY_ELEMENTS bytes) is refused as it streams."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    if raw[:2] == b"\x1f\x8b":
        limit = min(MAX_ARRAY_ELEMENTS, MAX_EXPANSION * max(len(raw), 1 << 20))
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
                raw = f.read(limit + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise DatasetError(f"{path}: corrupt or truncated gzip data ({e})") from None
        if len(raw) > limit:
            raise DatasetError(f"{path}: gzip data expands past {limit:,} bytes (MAX_EXPANSION, MAX_ARRAY_ELEMENTS)")
    return raw


def to_nchw(images: np.ndarray, where: str, *, channels_last: bool = True) -> np.ndarray:
    """uint8 [N, H, W] or [N, H, W, C] (channels_last) / [N, C, H, W] -> contiguous uint8 [N, C, H, W]."""
    if images.dtype != np.uint8:
        raise DatasetError(f"{where}: expected uint8 images, got {images.dtype}")
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and channels_last:
        images = images.transpose(0, 3, 1, 2)
    elif images.ndim != 4:
        raise DatasetError(f"{where}: expected images [N, H, W] or [N, H, W, C], got shape {list(images.shape)}")
    if images.shape[1] not in (1, 2, 3, 4) or min(images.shape[2:]) < 1:
        raise DatasetError(f"{where}: expected 1 to 4 channels and a positive size, got shape {list(images.shape)}")
    return np.ascontiguousarray(images)


def make_split(images: np.ndarray, labels: np.ndarray, where: str) -> Split:
    """Split from uint8 images [N, C, H, W] and integer labels [N], after checking that the lengths agree."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:  # Keras stores CIFAR labels as [N, 1]
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise DatasetError(f"{where}: expected a label vector [N], got shape {list(labels.shape)}")
    integral = labels.dtype.kind in "iu" or (
        labels.dtype.kind == "f" and np.all(np.isfinite(labels)) and np.all(labels == np.round(labels))
    )
    if not integral:
        raise DatasetError(f"{where}: labels must be integers, got {labels.dtype}")
    if len(images) != len(labels):
        raise DatasetError(f"{where}: {len(images)} images but {len(labels)} labels")
    if not images.flags.writeable:  # a view of a file's bytes: torch wants memory it may write
        images = images.copy()
    return Split(images=torch.from_numpy(images), labels=torch.from_numpy(labels.astype(np.int64)))


def check_labels(split: Split, n_classes: int, where: str) -> None:
    """DatasetError unless every label is in 0..n_classes-1."""
    if len(split) == 0:
        raise DatasetError(f"{where}: holds no images")
    lo, hi = int(split.labels.min()), int(split.labels.max())
    if lo < 0 or hi >= n_classes:
        bad = lo if lo < 0 else hi
        raise DatasetError(f"{where}: label {bad} is out of range (classes 0..{n_classes - 1})")


def finish(
    *,
    name: str,
    source: str,
    train: Split | None,
    test: Split,
    n_classes: int | None = None,
    class_names: tuple[str, ...] = (),
    where: str,
    digits: bool = False,
) -> Dataset:
    """Check the splits against each other and the class count (>= 2), and build the Dataset.

    Without `n_classes` (nor names), the classes are 0..max label over both splits.
    """
    if train is not None and tuple(train.images.shape[1:]) != tuple(test.images.shape[1:]):
        a, b = ("×".join(map(str, s.images.shape[1:])) for s in (train, test))
        raise DatasetError(f"{where}: train images are {a} but test images are {b}")
    if n_classes is None:
        tops = [int(s.labels.max()) for s in (train, test) if s is not None and len(s)]
        if not tops:
            raise DatasetError(f"{where}: holds no images")
        n_classes = len(class_names) or 1 + max(tops)
    if n_classes > MAX_CLASSES:
        raise DatasetError(f"{where}: labels reach {n_classes - 1:,}; at most {MAX_CLASSES:,} classes (MAX_CLASSES)")
    for split_name, split in (("train", train), ("test", test)):
        if split is not None:
            check_labels(split, n_classes, f"{where} ({split_name})")
    if n_classes < 2:
        raise DatasetError(f"{where}: only one class; a classifier needs at least 2")
    if class_names and len(class_names) != n_classes:
        raise DatasetError(f"{where}: {len(class_names)} class names for {n_classes} classes")
    return Dataset(
        name=name,
        source=source,
        train=train,
        test=test,
        n_classes=n_classes,
        class_names=tuple(class_names),
        digits=digits,
    )
