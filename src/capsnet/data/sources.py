"""Which reader a path needs, decided by content: IDX magic, .npz zip, CIFAR binary records, .mat headers,
smallNORB magic numbers, or a folder of class folders.

    detect(path) -> "idx" | "npz" | "cifar10" | "cifar100" | "svhn" | "smallnorb" | "folder"
    load(path, fmt, ...) -> Dataset
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import DatasetError
from . import cifar, folder, npz, smallnorb, svhn
from .download import DATASETS
from .idx import find_files, load_idx_folder
from .split import Dataset

FORMATS = ("idx", "npz", "cifar10", "cifar100", "svhn", "smallnorb", "folder")


def known_format(name: str) -> str:
    """The format of known set `name` ("idx" for the MNIST family)."""
    return DATASETS[name].get("format", "idx")


def detect(path: Path) -> str:
    """The format of the data at `path` (a file or folder); DatasetError naming what was looked for if none."""
    if path.is_file():
        if npz.is_npz(path):
            return "npz"
        raise DatasetError(f"{path}: not a data file capsnet reads (a .npz of x_train, y_train, x_test, y_test)")
    if not path.is_dir():
        raise DatasetError(f"{path}: no such file or folder")
    if find_files(path):
        return "idx"
    kind = cifar.detect(path)  # raises for the pickled python version
    if kind:
        return kind
    if svhn.detect(path):
        return "svhn"
    if smallnorb.detect(path):
        return "smallnorb"
    npzs = [p for p in sorted(path.glob("*.npz")) if npz.is_npz(p)]
    if len(npzs) == 1:
        return "npz"
    if folder.detect(path):
        return "folder"
    raise DatasetError(
        f"{path}: no data set found here: expected MNIST IDX files, a .npz, the CIFAR-10/100 binary files, SVHN's "
        "*_32x32.mat, smallNORB's *-dat.mat/-cat.mat, or class folders of images (<class>/*.png)"
    )


def complete(name: str, where: Path) -> bool:
    """Whether `where` holds every file known set `name` needs (so nothing is downloaded)."""
    fmt = known_format(name)
    if fmt == "idx":
        return len(find_files(where)) == 4
    info = DATASETS[name]
    wanted = [m for members in info.get("extract", {}).values() for m in members if m.endswith(".bin")]
    if fmt.startswith("cifar"):
        return all((cifar.data_folder(where, fmt) / m).is_file() for m in wanted)
    files = [f for f in info["files"] if f not in info.get("extract", {})]
    return all((where / f).is_file() or (where / f.removesuffix(".gz")).is_file() for f in files)


def load(path: Path, fmt: str, *, name: str, source: str, **options: Any) -> Dataset:
    """Read `path` with the reader of `fmt`. `options` go to the readers that take them: image folders
    (image_size, channels, test_fraction, seed, strict, cache_dir, workers), SVHN (extra), smallNORB (size, or a
    square image_size)."""
    return dataclasses.replace(_read(path, fmt, name=name, source=source, **options), kind=fmt)


def _square_side(image_size: Any) -> int | None:
    """The side of a square `image_size` option ("64", 64, (64, 64)); DatasetError for a non-square one."""
    size = folder.parse_size(image_size)
    if size is None:
        return None
    if size[0] != size[1]:
        raise DatasetError(f"image size {size[0]}x{size[1]}: smallNORB images are square; give one side")
    return size[0]


def _read(path: Path, fmt: str, *, name: str, source: str, **options: Any) -> Dataset:
    if fmt == "idx":  # a known set named as such: what its table says of it (Fashion-MNIST is not digits)
        known = {k: DATASETS.get(name, {})[k] for k in ("digits", "class_names") if k in DATASETS.get(name, {})}
        return dataclasses.replace(load_idx_folder(path, name=name, source=source), **known)
    if fmt == "npz":
        if path.is_dir():
            path = next(p for p in sorted(path.glob("*.npz")) if npz.is_npz(p))
        return npz.load_npz(path, name=name, source=source)
    if fmt in ("cifar10", "cifar100"):
        return cifar.load_cifar(path, fmt, name=name, source=source)
    if fmt == "svhn":
        return svhn.load_svhn(path, extra=bool(options.get("extra", False)), name=name, source=source)
    if fmt == "smallnorb":
        size = options.get("size") or _square_side(options.get("image_size")) or smallnorb.SIZE
        return smallnorb.load_smallnorb(path, size=size, name=name, source=source)
    if fmt == "folder":
        keys = ("image_size", "channels", "test_fraction", "val_fraction", "seed", "strict", "cache_dir", "workers")
        kwargs = {k: options[k] for k in keys if options.get(k) is not None}
        return folder.load_folder(path, name=name, source=source, **kwargs)
    raise DatasetError(f"{path}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
