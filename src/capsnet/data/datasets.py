"""Finding and loading data sets: a folder or file, the bundled sample, or a known set from the cache or its mirrors.

A path is read by the reader its content calls for (`capsnet.data.sources`): MNIST-format IDX files
(`train-images-idx3-ubyte`, ... each optionally gzipped), a .npz, CIFAR-10/100 binary files, SVHN .mat files,
smallNORB binary matrices, or a folder of class folders of images. Sets are held in memory (large image folders
memory-mapped) as uint8 tensors and converted to float on the training device, batch by batch.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

from ..errors import DatasetError
from . import sources
from .download import BUNDLED as BUNDLED  # the data set in the package
from .download import DATASETS, cache_root, missing_files_message, optional_files
from .download import download as _download
from .split import Dataset

_BUNDLED_DIR = Path(__file__).resolve().parent / "files" / BUNDLED

# The sets loaded last, by folder, keyed with file sizes and mtimes so an edited folder is read afresh: at most
# CACHE_SETS of them and CACHE_BYTES of images in all, the least recently used dropped first (a set larger than
# CACHE_BYTES is not kept). Loading the same set again (evaluate after train, a notebook cell run twice) is then free,
# while a process that goes through many sets holds only the last few.
CACHE_SETS = 4
CACHE_BYTES = 1 << 30
_CACHE: collections.OrderedDict[tuple, Dataset] = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()  # (threads may load sets at once)


def _nbytes(ds: Dataset) -> int:
    splits = [s for s in (ds.train, ds.test) if s is not None]
    return sum(s.images.nbytes + s.labels.nbytes for s in splits)


def _remember(key: tuple, ds: Dataset) -> None:
    with _CACHE_LOCK:
        _CACHE[key] = ds
        while _CACHE and (len(_CACHE) > CACHE_SETS or sum(map(_nbytes, _CACHE.values())) > CACHE_BYTES):
            _CACHE.popitem(last=False)


def _recall(key: tuple) -> Dataset | None:
    with _CACHE_LOCK:
        if key not in _CACHE:
            return None
        _CACHE.move_to_end(key)
        return _CACHE[key]


def clear_cache() -> None:
    """Forget every set loaded so far (their memory is freed once nothing else refers to them)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _load_cached(folder: Path, *, name: str, source: str, fmt: str | None = None, **options) -> Dataset:
    fmt = fmt or sources.detect(folder)
    if fmt == "folder":  # image folders keep their own on-disk cache, keyed on every file
        return sources.load(folder, fmt, name=name, source=source, **options)
    if folder.is_file():
        files = [folder]
    elif fmt == "idx":
        files = sorted(sources.find_files(folder).values())
    else:  # the folder's own files, and those of the subfolders the CIFAR archives unpack into
        dirs = [folder, *(folder / sub for sub in sources.cifar.SUBFOLDERS.values())]
        files = sorted(p for d in dirs if d.is_dir() for p in d.iterdir() if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(folder.resolve()), name, source, fmt, tuple(sorted(options.items())), stamp)
    hit = _recall(key)
    if hit is not None:
        return hit
    ds = sources.load(folder, fmt, name=name, source=source, **options)
    _remember(key, ds)
    return ds


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
        if path.is_file() and sources.npz.is_npz(path):
            return path.stem, path, str(path)
        raise DatasetError(f"{name_or_dir}: is a file but not a .npz; give a .npz or the folder that holds the data")
    if name_or_dir == BUNDLED:
        return BUNDLED, _BUNDLED_DIR, "bundled"
    if name_or_dir in DATASETS:
        cached = cache_root(cache_dir) / name_or_dir
        candidates = [cached, *(Path(d) for d in DATASETS[name_or_dir].get("system_dirs", []))]
        for folder in candidates:
            if sources.complete(name_or_dir, folder):
                return name_or_dir, folder, str(folder)
        return name_or_dir, None, str(cached)
    known = ", ".join([BUNDLED, *DATASETS])
    if os.sep in name_or_dir or "/" in name_or_dir:
        raise DatasetError(f"{name_or_dir}: no such folder (known data set names: {known})")
    raise DatasetError(f"{name_or_dir}: neither a folder nor a known data set (known: {known})")


def dataset_format(name_or_dir: str = BUNDLED, *, data_dir: str | None = None, cache_dir: str | None = None) -> str:
    """The format (capsnet.data.sources.FORMATS) that `load_dataset` would read, found without loading or
    downloading anything: from the files' content, or for a known set not yet downloaded, its registry entry."""
    name, folder, _ = resolve(name_or_dir, data_dir=data_dir, cache_dir=cache_dir)
    return sources.detect(folder) if folder is not None else sources.known_format(name)


def load_dataset(
    name_or_dir: str = BUNDLED,
    *,
    data_dir: str | None = None,
    download: bool = True,
    cache_dir: str | None = None,
    mirrors: list[str] | None = None,
    **options,
) -> Dataset:
    """Load a data set: a folder or .npz (`data_dir`, or `name_or_dir` if it is one), the bundled
    "mnist-sample", or a known set ("mnist", "fashion-mnist", "kmnist", "cifar10", "cifar100", "svhn",
    "smallnorb") from the cache, a system folder or, failing those and if `download`, from its mirrors into the
    cache. `options` go to the reader (`capsnet.data.sources.load`): for image folders image_size ("H" or
    "HxW"), channels (1|3), test_fraction, seed, strict; for SVHN extra=True."""
    name, folder, source = resolve(name_or_dir, data_dir=data_dir, cache_dir=cache_dir)
    # Optional files the options ask for (SVHN's extra): fetched into the cache folder when it lacks them.
    optional = optional_files(name, options) if data_dir is None else {}
    in_cache = folder is None or folder == cache_root(cache_dir) / name
    if folder is None or (in_cache and not all((folder / f).is_file() for f in optional)):
        folder = Path(source) if folder is None else folder
        if not download:
            raise DatasetError(f"{name} is not downloaded (download disabled); " + missing_files_message(name, folder))
        _download(name, folder, mirrors=mirrors, optional=optional)
    return _load_cached(folder, name=name, source=source, **options)
