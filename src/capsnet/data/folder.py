"""Image folders: `root/<class>/*.png` (or jpg, jpeg, bmp, gif, webp, tif), one folder per class.

Three layouts:
  root/train/<class>/..., root/val/<class>/... and root/test/<class>/...   the given splits (val: validation)
  root/train/<class>/...  and  root/test/<class>/...  (or root/val/)     the given split (val/ as the test split)
  root/<class>/...                                                        split by `test_fraction`, stratified, seeded

Class names are the sorted folder names. Images of mixed sizes and modes are converted at load time to
`image_size` (H, W) and `channels` (1: greyscale, 3: RGB); by default the most common size and mode found.
Decoding runs in threads (Pillow releases the GIL). The decoded uint8 array is cached as .npy under
`cache_root()/folders/`, keyed on the files' paths, sizes and mtimes and the options, so a second run starts at
once; a set larger than MMAP_BYTES is memory-mapped from there rather than read into memory.

An unreadable file (empty, truncated, not an image) is skipped with one warning line naming the count and the
first few paths; `strict=True` makes it an error. Pillow is the optional extra `capsnet[images]`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..configs.base import parse_size as parse_size
from ..errors import CapsNetError, DatasetError
from ..fileio import atomic_open, temporary_beside
from ..limits import MAX_ARRAY_ELEMENTS
from ..logs import LOGGER
from .arrays import finish
from .download import cache_root
from .images import check_pixels, flatten_alpha
from .split import Split

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MMAP_BYTES = 512 << 20  # decoded sets larger than this stay memory-mapped
_GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}
CACHE_VERSION = 2  # 2: transparent images laid on paper (images.flatten_alpha)


def pillow():
    try:
        from PIL import Image
    except ImportError:
        raise CapsNetError("reading image folders needs Pillow: pip install 'capsnet[images]'") from None
    return Image


def _class_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS)


def split_dirs(root: Path) -> tuple[Path, Path | None, Path | None]:
    """(train folder, test folder or None, validation folder or None): root/train with root/test and root/val
    (validation), root/train with root/test or root/val (the test split), or root itself (then None, None)."""
    if (root / "train").is_dir():
        test, val = (root / "test", root / "val")
        if test.is_dir():
            return root / "train", test, val if val.is_dir() else None
        return root / "train", val if val.is_dir() else None, None
    return root, None, None


def detect(root: Path) -> bool:
    """Whether `root` looks like an image folder: class folders (under train/ or directly) holding images."""
    train, _, _ = split_dirs(root)
    try:
        return any(_images_in(d) for d in _class_dirs(train))
    except OSError:
        return False


def _list_classes(folder: Path) -> dict[str, list[Path]]:
    classes = {d.name: _images_in(d) for d in _class_dirs(folder)}
    if not classes:
        raise DatasetError(f"{folder}: no class folders (expected {folder}/<class>/<image files>)")
    empty = [name for name, files in classes.items() if not files]
    if empty:
        raise DatasetError(
            f"{folder / empty[0]}: class folder with no images (.png, .jpg, .jpeg, .bmp, .gif, .webp, .tif)"
        )
    return classes


def class_names(root: str | os.PathLike) -> list[str]:
    """The class names of the image folder `root` (its training class folders, sorted) as `load_folder` names
    them, from listing the folders alone: no image is opened."""
    return sorted(_list_classes(split_dirs(Path(root))[0]))


def _entries(root: Path, test_fraction: float, seed: int) -> tuple[list[str], list[tuple[Path, int]], list[int]]:
    """(class names, [(file, label)] as the training files, then the test files, then the validation files, and
    the sizes of those three parts)."""
    train_dir, test_dir, val_dir = split_dirs(root)
    train_classes = _list_classes(train_dir)
    names = sorted(train_classes)
    if len(names) < 2:
        raise DatasetError(f"{train_dir}: only one class folder ({names[0]}); a classifier needs at least 2")
    index = {n: k for k, n in enumerate(names)}
    if test_dir is not None:
        parts = [[(p, index[n]) for n in names for p in train_classes[n]]]
        for folder in (test_dir, val_dir) if val_dir is not None else (test_dir,):
            classes = _list_classes(folder)
            extra = sorted(set(classes) - set(names))
            if extra:
                raise DatasetError(f"{folder / extra[0]}: class {extra[0]!r} has no training folder in {train_dir}")
            parts.append([(p, index[n]) for n in sorted(classes) for p in classes[n]])
        return names, [e for part in parts for e in part], [len(part) for part in parts]
    if not 0 < test_fraction < 1:
        raise DatasetError(f"{root}: test_fraction must be in (0, 1) to split one folder, got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for n in names:  # stratified: each class gives round(test_fraction · count) test images, at least one
        files = train_classes[n]
        order = rng.permutation(len(files))
        n_test = min(max(1, round(test_fraction * len(files))), len(files) - 1) if len(files) > 1 else 0
        test += [(files[i], index[n]) for i in sorted(order[:n_test])]
        train += [(files[i], index[n]) for i in sorted(order[n_test:])]
    if not test:
        raise DatasetError(f"{root}: too few images to hold out a test split (give train/ and test/ folders)")
    return names, train + test, [len(train), len(test)]


def _probe(path: Path) -> tuple[int, int, int] | None:
    """(height, width, channels) from the header, or None if the file is not an image Pillow can open."""
    Image = pillow()
    try:
        with Image.open(path) as im:
            return im.size[1], im.size[0], 1 if im.mode in _GREY_MODES else 3
    except Exception:  # Pillow raises many types for foreign or damaged files
        return None


def native_shape(root: str | os.PathLike, *, sample: int = 256) -> tuple[int, int, int] | None:
    """The most common (channels, height, width) among the first `sample` readable files of the image folder `root`
    (header reads only), or None when none can be read: what the reader converts from."""
    files = [p for p, _ in _entries(Path(root), 0.5, 0)[1][:sample]]
    probes = [p for p in map(_probe, files) if p is not None]
    if not probes:
        return None
    h, w, c = collections.Counter(probes).most_common(1)[0][0]
    return c, h, w


def _decode(path: Path, size: tuple[int, int], channels: int) -> np.ndarray | None:
    """uint8 [C, H, W] of the image converted and resized, or None if it cannot be decoded."""
    Image = pillow()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # (check_pixels is the stricter guard)
            with Image.open(path) as im:
                check_pixels(path, im.size)  # (a decompression bomb is skipped as unreadable)
                im.load()
                img = flatten_alpha(im).convert("L" if channels == 1 else "RGB")  # (as predict reads a file)
        if img.size != (size[1], size[0]):
            img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        arr = np.asarray(img, dtype=np.uint8)
    except Exception:
        return None
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _cache_key(root: Path, files: list[Path], options: dict) -> str:
    h = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "root": str(root.resolve()), **options}).encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _warn_skipped(skipped: list[str], strict: bool, root: Path) -> None:
    if not skipped:
        return
    first = ", ".join(skipped[:3]) + (f" (+{len(skipped) - 3} more)" if len(skipped) > 3 else "")
    if strict:
        raise DatasetError(f"{root}: {len(skipped)} unreadable image file(s): {first}")
    LOGGER.warning(
        f"capsnet: warning: skipped {len(skipped)} unreadable image file(s) in {root}: {first} "
        "(--strict makes this an error)"
    )


def _decode_all(files, size, channels, workers, dest: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """Decode every file into uint8 [N, C, H, W] (a .npy memmap at `dest` when given) and a readable mask. On an
    exception or Ctrl-C the files not yet started are cancelled, so it returns at once (the caller cleans up)."""
    shape = (len(files), channels, *size)
    if np.prod(shape, dtype=np.float64) > MAX_ARRAY_ELEMENTS:
        raise DatasetError(
            f"{len(files)} images of {channels}×{size[0]}×{size[1]} are more than the "
            f"{MAX_ARRAY_ELEMENTS:,} values one data set may hold (MAX_ARRAY_ELEMENTS)"
        )
    out = np.lib.format.open_memmap(dest, mode="w+", dtype=np.uint8, shape=shape) if dest else np.empty(shape, np.uint8)
    ok = np.zeros(len(files), dtype=bool)

    def work(i: int) -> None:
        arr = _decode(files[i], size, channels)
        if arr is not None:
            out[i], ok[i] = arr, True

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        list(pool.map(work, range(len(files))))
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # the few running decodes finish; the queued ones never start
        raise
    pool.shutdown(wait=True)
    return out, ok


def _read_cache(cache: Path, n_files: int) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """(images, ok mask, [C, H, W]) of a complete cache entry for `n_files` files; None when the entry is absent or
    does not hold what its meta.json says (a file missing, truncated or of another shape): it is then rebuilt."""
    try:
        meta = json.loads((cache / "meta.json").read_text(encoding="utf-8"))
        target = [int(v) for v in meta["shape"]]
        images = np.load(cache / "images.npy", mmap_mode="c")
        ok = np.load(cache / "ok.npy")
    except (OSError, ValueError, KeyError, TypeError, EOFError):  # absent, unreadable or not what was written
        return None
    if meta.get("files") != n_files or len(target) != 3 or images.dtype != np.uint8 or ok.dtype != bool:
        return None
    if images.shape != (n_files, *target) or ok.shape != (n_files,):
        return None
    return (np.array(images) if images.nbytes <= MMAP_BYTES else images), ok, target


def _decode_cached(root, files, size, channels, workers, cache: Path) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(images, ok mask, target [C, H, W]) from the cache folder, decoding and writing it on a miss."""
    hit = _read_cache(cache, len(files))
    if hit is not None:
        return hit
    with ThreadPoolExecutor(max_workers=workers) as pool:
        probes = list(pool.map(_probe, files))
    readable = [p for p in probes if p is not None]
    if not readable:
        raise DatasetError(f"{root}: none of the {len(files)} image files can be read")
    size = size or collections.Counter(p[:2] for p in readable).most_common(1)[0][0]
    channels = channels or collections.Counter(p[2] for p in readable).most_common(1)[0][0]
    probed = np.array([p is not None for p in probes])
    try:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "meta.json").unlink(missing_ok=True)  # an entry that failed its check is incomplete until rewritten
        with temporary_beside(cache / "images.npy", suffix=".npy") as tmp:  # removed on every way out
            images, ok = _decode_all(files, size, channels, workers, tmp)
            if isinstance(images, np.memmap):  # (always, with a cache folder)
                images.flush()
            del images  # (the memmap's file is moved next)
            ok &= probed
            os.replace(tmp, cache / "images.npy")
        with atomic_open(cache / "ok.npy", "wb") as f:
            np.save(f, ok)
        with atomic_open(cache / "meta.json", "w") as f:  # written last: its presence marks a complete entry
            json.dump({"shape": [channels, *size], "root": str(root), "files": len(files)}, f)
    except OSError:  # a read-only cache folder (or a full disk): decode into memory, uncached
        images, ok = _decode_all(files, size, channels, workers, None)
        return images, ok & probed, [channels, *size]
    hit = _read_cache(cache, len(files))
    if hit is None:
        raise DatasetError(f"{cache}: the decoded images written there cannot be read back")
    return hit


def load_folder(
    root: str | os.PathLike,
    *,
    image_size: str | int | tuple[int, int] | None = None,
    channels: int | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
    strict: bool = False,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    name: str | None = None,
    source: str | None = None,
    val_fraction: float | None = None,
):
    """Load an image folder as a `Dataset` (see the module docstring for the layouts and options).

    `val_fraction` is the deprecated name of `test_fraction` (the share of each class held out for *testing* when
    the folder has no test split); a validation split is held out of the training split by the training task."""
    if val_fraction is not None:
        warnings.warn(
            "load_folder(val_fraction=) is deprecated: it holds out test images; use test_fraction=",
            DeprecationWarning,
            stacklevel=2,
        )
        test_fraction = val_fraction
    root = Path(root)
    size = parse_size(image_size)
    if channels not in (None, 1, 3):
        raise DatasetError(f"channels must be 1 (greyscale) or 3 (RGB), got {channels}")
    pillow()
    names, entries, sizes = _entries(root, test_fraction, seed)
    files = [p for p, _ in entries]
    labels = np.array([k for _, k in entries], dtype=np.int64)
    options = {"size": size, "channels": channels, "test_fraction": test_fraction, "seed": seed}
    cache = cache_root(cache_dir) / "folders" / f"{root.resolve().name}-{_cache_key(root, files, options)}"
    workers = workers or min(8, os.cpu_count() or 1)
    images, ok, _ = _decode_cached(root, files, size, channels, workers, cache)
    _warn_skipped([str(f) for f, good in zip(files, ok) if not good], strict, root)

    def part(lo: int, hi: int) -> Split:
        keep = ok[lo:hi]
        x = images[lo:hi] if keep.all() else images[lo:hi][keep]  # a slice stays memory-mapped
        return Split(torch.from_numpy(x), torch.from_numpy(labels[lo:hi][keep]))

    bounds = np.cumsum([0, *sizes])
    train, test, *val = (part(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds))
    counts = np.bincount(train.labels.numpy(), minlength=len(names))
    if (counts == 0).any():
        missing = names[int(np.flatnonzero(counts == 0)[0])]
        raise DatasetError(f"{root}: class {missing!r} has no readable training image")
    data = finish(
        name=name or root.resolve().name,
        source=source or str(root),
        train=train,
        test=test,
        n_classes=len(names),
        class_names=tuple(names),
        where=str(root),
    )
    return dataclasses.replace(data, val=val[0]) if val else data
