"""Atomic file and folder writes: a kill at any moment leaves either the old file or the new one, never half of one.

Every temporary file is created by `tempfile.mkstemp` (O_CREAT|O_EXCL, a random name, mode 0600) in the target's
own folder: a symlink or file planted at a predictable name is never followed nor overwritten; a whole folder is built
in a `staging_folder` (mkdtemp beside it) and renamed into place. A write that fails (a full disk) raises the OSError
naming the target, and the target keeps what it held.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NoReturn


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path`; on success fsync it and `os.replace` it over `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files; mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, mode, encoding="utf-8" if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _reraise_named(e, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def temporary_beside(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """A new empty file of a random name (mkstemp) in `path`'s folder, ending in `suffix`, for a writer that takes a
    file name (torch.export.save, ONNX, a NumPy memmap); removed on the way out unless it was moved. The caller
    moves it over `path` with `os.replace` once it is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        yield tmp
    except OSError as e:
        _reraise_named(e, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def staging_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A new empty folder of a random name (mkdtemp, mode 0700) in `path`'s parent, in which a writer builds a whole
    folder before renaming it to `path`; removed with what it holds on the way out unless it was renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _reraise_named(e: OSError, path: Path) -> NoReturn:
    """Raise `e`, or when it names no file (a write to an open file: a full disk), the same error naming `path`."""
    if e.filename is not None or e.errno is None:
        raise e
    raise type(e)(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
