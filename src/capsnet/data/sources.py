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
    (image_size, channels, test_fraction, seed, strict, cache_dir, workers), SVHN (extra), smallNORB (size). A known
    set's own description (download.DATASETS: `digits`, `class_names`) replaces what its format implies."""
    known = {k: v for k, v in DATASETS.get(name, {}).items() if k in ("digits", "class_names")}
    return dataclasses.replace(_read(path, fmt, name=name, source=source, **options), kind=fmt, **known)


def _read(path: Path, fmt: str, *, name: str, source: str, **options: Any) -> Dataset:
    if fmt == "idx":
        return load_idx_folder(path, name=name, source=source)
    if fmt == "npz":
        if path.is_dir():
            path = next(p for p in sorted(path.glob("*.npz")) if npz.is_npz(p))
        return npz.load_npz(path, name=name, source=source)
    if fmt in ("cifar10", "cifar100"):
        return cifar.load_cifar(path, fmt, name=name, source=source)
    if fmt == "svhn":
        return svhn.load_svhn(path, extra=bool(options.get("extra", False)), name=name, source=source)
    if fmt == "smallnorb":
        return smallnorb.load_smallnorb(path, size=options.get("size") or smallnorb.SIZE, name=name, source=source)
    if fmt == "folder":
        keys = ("image_size", "channels", "test_fraction", "val_fraction", "seed", "strict", "cache_dir", "workers")
        kwargs = {k: options[k] for k in keys if options.get(k) is not None}
        return folder.load_folder(path, name=name, source=source, **kwargs)
    raise DatasetError(f"{path}: unknown format {fmt!r}; known: {', '.join(FORMATS)}")
