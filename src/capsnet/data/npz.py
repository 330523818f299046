"""NumPy `.npz` data sets in the Keras convention: `x_train, y_train, x_test, y_test`.

Images are uint8 [N, H, W] or [N, H, W, C]; labels integers [N] (or [N, 1], as Keras stores CIFAR). An optional
`class_names` array (strings) names the classes. Loaded with `allow_pickle=False`: an object array is refused.
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path

import numpy as np

from ..errors import DatasetError
from ..limits import array_too_large
from .arrays import finish, make_split, to_nchw
from .split import Dataset

KEYS = ("x_train", "y_train", "x_test", "y_test")


def is_npz(path: Path) -> bool:
    """Whether `path` is a file whose content is a zip archive (what np.savez writes)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _check_declared_sizes(path: Path) -> None:
    """DatasetError if an array of the archive declares more values than may be read (capsnet.limits), from the
    .npy headers alone: a small compressed file may declare gigabytes."""
    try:
        size = path.stat().st_size
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError):
        return  # (not a zip archive: np.load below says why, in its words)
    with archive:
        for member in archive.infolist():
            try:
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(f)
            except MemoryError:
                raise
            except Exception as e:  # (numpy parses the header as Python literals: many error types)
                raise DatasetError(
                    f"{path}: {member.filename} is not a readable .npy array ({type(e).__name__})"
                ) from None
            why = array_too_large(math.prod(shape), dtype.itemsize, size)
            if why:
                raise DatasetError(f"{path}: {member.filename}: {why}")


def load_npz(path: str | os.PathLike, *, name: str | None = None, source: str | None = None) -> Dataset:
    path = Path(path)
    where = str(path)
    _check_declared_sizes(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("x_test", "y_test") if k not in z.files]
            if missing:
                raise DatasetError(f"{where}: no {', '.join(missing)} (expected arrays {', '.join(KEYS)})")
            if ("x_train" in z.files) != ("y_train" in z.files):
                raise DatasetError(f"{where}: x_train and y_train come together (found only one)")
            arrays = {k: z[k] for k in (*KEYS, "class_names") if k in z.files}
    except DatasetError:
        raise
    except ValueError as e:  # object arrays need pickle, which stays off
        raise DatasetError(f"{where}: cannot be read without pickle ({e}); save plain numeric arrays") from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DatasetError(f"{where}: not a readable .npz file ({e})") from None
    train = None
    if "x_train" in arrays:
        train = make_split(to_nchw(arrays["x_train"], f"{where} x_train"), arrays["y_train"], f"{where} train")
    test = make_split(to_nchw(arrays["x_test"], f"{where} x_test"), arrays["y_test"], f"{where} test")
    names: tuple[str, ...] = ()
    if "class_names" in arrays:
        raw = arrays["class_names"]
        if raw.dtype.kind not in "US" or raw.ndim != 1:
            raise DatasetError(f"{where}: class_names must be a 1-d array of strings")
        names = tuple(str(n.decode() if isinstance(n, bytes) else n) for n in raw)
    return finish(
        name=name or path.stem,
        source=source or where,
        train=train,
        test=test,
        class_names=names,
        where=where,
    )
