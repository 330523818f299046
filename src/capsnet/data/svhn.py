"""SVHN, cropped digits (http://ufldl.stanford.edu/housenumbers/): `train_32x32.mat`, `test_32x32.mat` and the
optional `extra_32x32.mat`.

Each file is a MATLAB v5 .mat file with `X` uint8 [32, 32, 3, N] and `y` [N, 1] with labels 1..10, where 10 means
the digit 0. Read with scipy.io.loadmat (the optional extra `capsnet[mat]`), after checking the file's header.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from ..limits import array_too_large
from .arrays import finish, make_split
from .split import Dataset, Split

FILES = ("train_32x32.mat", "test_32x32.mat")
EXTRA = "extra_32x32.mat"


def mat_header(path: Path) -> str:
    """The text of a .mat file's 116-byte header ("MATLAB 5.0 MAT-file, ..."), or "" if it has none."""
    try:
        with open(path, "rb") as f:
            head = f.read(128)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from None
    return head[:116].decode("latin-1") if head.startswith(b"MATLAB") else ""


ITEM_BYTES = {"int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "single": 4}  # else 8


def check_declared_sizes(path: Path) -> None:
    """DatasetError when a variable the .mat file declares (its header, read by scipy's whosmat without the data)
    is larger than capsnet.limits allows: a few bytes can declare gigabytes."""
    from scipy.io import whosmat

    try:
        declared = whosmat(str(path))
    except Exception as e:  # scipy raises several types for corrupt or truncated files
        raise DatasetError(f"{path}: corrupt or truncated .mat file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for name, shape, kind in declared:
        elements = int(np.prod(shape, dtype=np.float64)) if shape else 0
        why = array_too_large(elements, ITEM_BYTES.get(kind, 8), size)
        if why is not None:
            raise DatasetError(f"{path}: variable {name} {list(shape)}: {why}")


def read_mat(path: Path) -> Split:
    """One SVHN .mat file -> Split (uint8 [N, 3, 32, 32], labels 0..9 with 10 mapped to 0)."""
    header = mat_header(path)
    if not header.startswith("MATLAB 5.0"):
        what = "a MATLAB 7.3 (HDF5) file" if header.startswith("MATLAB 7.3") else "not a MATLAB v5 .mat file"
        raise DatasetError(f"{path}: {what}; SVHN's cropped digits are MATLAB v5 files (X, y)")
    try:
        from scipy.io import loadmat
    except ImportError:
        raise DatasetError(f"{path}: reading SVHN .mat files needs scipy: pip install 'capsnet[mat]'") from None
    check_declared_sizes(path)
    try:
        mat = loadmat(str(path), variable_names=["X", "y"])
    except Exception as e:  # scipy raises several types for corrupt or truncated files
        raise DatasetError(f"{path}: corrupt or truncated .mat file ({type(e).__name__}: {e})") from None
    if "X" not in mat or "y" not in mat:
        raise DatasetError(f"{path}: expected variables X and y (SVHN cropped digits)")
    x, y = mat["X"], np.asarray(mat["y"]).reshape(-1)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[2] not in (1, 3):
        raise DatasetError(f"{path}: expected X uint8 [H, W, 3, N], got {x.dtype} {list(x.shape)}")
    if len(y) and (y.min() < 1 or y.max() > 10):
        bad = y.min() if y.min() < 1 else y.max()
        raise DatasetError(f"{path}: label {bad:g} is out of range (SVHN labels are 1..10, 10 for the digit 0)")
    images = np.ascontiguousarray(x.transpose(3, 2, 0, 1))  # [H, W, C, N] -> [N, C, H, W]
    return make_split(images, np.where(y == 10, 0, y).astype(np.int64), str(path))


def detect(folder: Path) -> bool:
    return any((folder / f).is_file() for f in FILES)


def load_svhn(folder: Path, *, extra: bool = False, name: str | None = None, source: str | None = None) -> Dataset:
    """Load SVHN from `folder`; with `extra`, `extra_32x32.mat` is appended to the training split."""
    if not (folder / FILES[1]).is_file():
        raise DatasetError(f"{folder}: no {FILES[1]} (every data set needs a test split)")
    train = read_mat(folder / FILES[0]) if (folder / FILES[0]).is_file() else None
    if extra:
        more = read_mat(folder / EXTRA)
        train = (
            more
            if train is None
            else Split(torch.cat([train.images, more.images]), torch.cat([train.labels, more.labels]))
        )
    test = read_mat(folder / FILES[1])
    return finish(
        name=name or "svhn",
        source=source or str(folder),
        train=train,
        test=test,
        n_classes=10,
        class_names=tuple(map(str, range(10))),
        where=str(folder),
        digits=False,
    )
