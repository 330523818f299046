"""CIFAR-10 and CIFAR-100, binary version (https://www.cs.toronto.edu/~kriz/cifar.html).

Each record is its label byte(s) and then 3,072 bytes of pixels: 1,024 red, 1,024 green, 1,024 blue, each 32×32
row-major. CIFAR-10 (`cifar-10-batches-bin/`): `data_batch_1.bin` … `data_batch_5.bin` (10,000 records each) and
`test_batch.bin`, one label byte; class names in `batches.meta.txt`. CIFAR-100 (`cifar-100-binary/`):
`train.bin` (50,000) and `test.bin` (10,000), a coarse and then a fine label byte (the fine label, 100 classes, is
used); names in `fine_label_names.txt`.

The "python version" (`data_batch_1`, `batches.meta`: pickles) is refused: unpickling runs code from the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DatasetError
from .arrays import finish, make_split, read_bytes
from .split import Dataset, Split

PIXELS = 3 * 32 * 32
# The names in CIFAR-10's batches.meta.txt, used when that file is absent.
CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SUBFOLDERS = {"cifar10": "cifar-10-batches-bin", "cifar100": "cifar-100-binary"}
FILES = {
    "cifar10": ([f"data_batch_{i}.bin" for i in range(1, 6)], ["test_batch.bin"], "batches.meta.txt"),
    "cifar100": (["train.bin"], ["test.bin"], "fine_label_names.txt"),
}
PICKLED = ("data_batch_1", "test_batch", "batches.meta", "train", "test", "meta")
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def data_folder(folder: Path, kind: str) -> Path:
    """`folder`, or its `cifar-10-batches-bin` / `cifar-100-binary` subfolder (as the archive unpacks)."""
    sub = folder / SUBFOLDERS[kind]
    return sub if sub.is_dir() else folder


def detect(folder: Path) -> str | None:
    """ "cifar10" or "cifar100" when `folder` holds that binary distribution, else None.

    DatasetError for the pickled python version, so it is named rather than reported as "unknown format".
    """
    for kind in ("cifar10", "cifar100"):
        base = data_folder(folder, kind)
        train, test, _ = FILES[kind]
        if (base / test[0]).is_file() or any((base / f).is_file() for f in train):
            return kind
    for base in (folder, folder / "cifar-10-batches-py", folder / "cifar-100-python"):
        pickled = [p for p in (base / n for n in PICKLED) if p.is_file() and _is_pickle(p)]
        if pickled:
            raise DatasetError(
                f"{pickled[0]}: the pickled CIFAR 'python version' is refused (it is never unpickled: that can run "
                "code); use the binary version (cifar-10-binary.tar.gz / cifar-100-binary.tar.gz), or the names "
                "cifar10 / cifar100 to download it"
            )
    return None


def _is_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) in _PICKLE_MAGIC


def read_records(path: Path, label_bytes: int, n_classes: int) -> Split:
    """One binary batch file -> Split (uint8 [N, 3, 32, 32], labels of the last label byte)."""
    raw = read_bytes(path)
    if raw[:2] in _PICKLE_MAGIC:
        raise DatasetError(f"{path}: a pickle, not the CIFAR binary format (the python version is refused)")
    record = label_bytes + PIXELS
    if len(raw) == 0 or len(raw) % record:
        raise DatasetError(
            f"{path}: {len(raw)} bytes is not a whole number of {record}-byte CIFAR records (truncated or not CIFAR)"
        )
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, record)
    labels = rows[:, label_bytes - 1]
    if int(labels.max()) >= n_classes:
        raise DatasetError(f"{path}: label {int(labels.max())} is out of range (classes 0..{n_classes - 1})")
    images = np.ascontiguousarray(rows[:, label_bytes:]).reshape(-1, 3, 32, 32)
    return make_split(images, labels, str(path))


def _cat(splits: list[Split]) -> Split:
    import torch

    return Split(torch.cat([s.images for s in splits]), torch.cat([s.labels for s in splits]))


def _names(path: Path, n_classes: int, default: tuple[str, ...]) -> tuple[str, ...]:
    if not path.is_file():
        return default
    names = tuple(line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines())
    names = tuple(n for n in names if n)
    if len(names) != n_classes:
        raise DatasetError(f"{path}: {len(names)} class names, expected {n_classes}")
    return names


def load_cifar(folder: Path, kind: str, *, name: str | None = None, source: str | None = None) -> Dataset:
    """Load CIFAR-10 (`kind="cifar10"`) or CIFAR-100 from `folder` (or its archive subfolder)."""
    base = data_folder(folder, kind)
    train_files, test_files, names_file = FILES[kind]
    label_bytes, n_classes = (1, 10) if kind == "cifar10" else (2, 100)
    present = [f for f in train_files if (base / f).is_file()]
    if kind == "cifar10" and present and len(present) != len(train_files):
        lack = sorted(set(train_files) - set(present))
        raise DatasetError(f"{base}: CIFAR-10 training batches missing: {', '.join(lack)}")
    if not (base / test_files[0]).is_file():
        raise DatasetError(f"{base}: no {test_files[0]} (every data set needs a test split)")
    train = _cat([read_records(base / f, label_bytes, n_classes) for f in present]) if present else None
    test = read_records(base / test_files[0], label_bytes, n_classes)
    names = _names(base / names_file, n_classes, CIFAR10_NAMES if kind == "cifar10" else ())
    return finish(
        name=name or kind,
        source=source or str(base),
        train=train,
        test=test,
        n_classes=n_classes,
        class_names=names,
        where=str(base),
    )
