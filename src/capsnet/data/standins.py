"""Stand-in data sets written in the real file formats (CIFAR binary, SVHN .mat, smallNORB binary matrices, .npz,
image folders), for tests and `capsnet reproduce ... --quick` where the real sets cannot be downloaded.

The images are synthetic and learnable: class k is a bright square at a class-dependent place and colour over
noise. They exercise the readers and the pipeline; they say nothing about accuracy on the real sets.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from ..fileio import atomic_write_bytes
from .cifar import CIFAR10_NAMES
from .smallnorb import PREFIX

_MAGIC = {np.dtype("uint8"): 0x1E3D4C55, np.dtype("int32"): 0x1E3D4C54}


def pattern_images(labels: np.ndarray, channels: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [N, C, H, W]: noise plus a square whose position (and, with colour, channel) depends on the label."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    x = rng.integers(0, 60, size=(n, channels, height, width), dtype=np.uint8)
    side = max(2, min(height, width) // 4)
    for i, k in enumerate(labels.tolist()):
        row = (k * 7 % 3) * (height - side) // 2
        col = (k * 5 % 4) * (width - side) // 3
        c = k % channels
        x[i, c, row : row + side, col : col + side] = 230
        if channels > 1:
            x[i, (c + 1) % channels, row : row + side, col : col + side] = 40 + 40 * (k // channels % 5)
    return x


def _labels(n: int, n_classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 7).permutation(np.arange(n) % n_classes)


def write_cifar(
    folder: str | os.PathLike, kind: str = "cifar10", *, n_train: int = 50, n_test: int = 20, seed: int = 0
) -> Path:
    """CIFAR binary files into `folder`: CIFAR-10's five data batches + test batch + batches.meta.txt, or
    CIFAR-100's train.bin/test.bin (coarse and fine label bytes) + fine_label_names.txt."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_classes = 10 if kind == "cifar10" else 100

    def records(n: int, s: int) -> bytes:
        fine = _labels(n, n_classes, s).astype(np.uint8)
        heads = [fine[:, None]] if kind == "cifar10" else [(fine // 5)[:, None], fine[:, None]]
        pixels = pattern_images(fine, 3, 32, 32, s).reshape(n, -1)
        return np.concatenate([*heads, pixels], axis=1).tobytes()

    if kind == "cifar10":
        per = -(-n_train // 5)
        for i in range(5):
            atomic_write_bytes(folder / f"data_batch_{i + 1}.bin", records(per, seed + i))
        atomic_write_bytes(folder / "test_batch.bin", records(n_test, seed + 10))
        (folder / "batches.meta.txt").write_text("\n".join(CIFAR10_NAMES) + "\n\n", encoding="utf-8")
    else:
        atomic_write_bytes(folder / "train.bin", records(n_train, seed))
        atomic_write_bytes(folder / "test.bin", records(n_test, seed + 10))
        names = "\n".join(f"class_{k:03d}" for k in range(100))
        (folder / "fine_label_names.txt").write_text(names + "\n", encoding="utf-8")
    return folder


def write_svhn(folder: str | os.PathLike, *, n_train: int = 40, n_test: int = 20, seed: int = 0) -> Path:
    """SVHN's train_32x32.mat and test_32x32.mat (MATLAB v5, X [32, 32, 3, N] uint8, y [N, 1] in 1..10). Needs scipy."""
    from scipy.io import savemat

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n, s in (("train_32x32.mat", n_train, seed), ("test_32x32.mat", n_test, seed + 10)):
        digits = _labels(n, 10, s)
        x = pattern_images(digits, 3, 32, 32, s).transpose(2, 3, 1, 0)  # [N, C, H, W] -> [H, W, C, N]
        y = np.where(digits == 0, 10, digits).astype(np.uint8)[:, None]
        savemat(str(folder / name), {"X": np.ascontiguousarray(x), "y": y})
    return folder


def matrix_bytes(arr: np.ndarray) -> bytes:
    """NYU's binary matrix encoding of `arr` (uint8 or int32): magic, ndim, max(3, ndim) dims, data (LE)."""
    dims = list(arr.shape) + [1] * max(0, 3 - arr.ndim)
    header = np.array([_MAGIC[arr.dtype], arr.ndim, *dims], dtype="<i4").tobytes()
    return header + arr.astype(arr.dtype.newbyteorder("<")).tobytes()


def write_smallnorb(
    folder: str | os.PathLike, *, n_train: int = 30, n_test: int = 20, size: int = 96, gz: bool = True, seed: int = 0
) -> Path:
    """smallNORB's six files (dat ubyte [N, 2, size, size], cat int32 [N], info int32 [N, 4]), gzipped or not."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", n_train, seed), ("test", n_test, seed + 10)):
        cat = _labels(n, 5, s).astype(np.int32)
        dat = pattern_images(cat, 2, size, size, s)
        info = np.random.default_rng(s).integers(0, 9, size=(n, 4)).astype(np.int32)
        for part, arr in (("dat", dat), ("cat", cat), ("info", info)):
            data = matrix_bytes(arr)
            name = f"{PREFIX[split]}-{part}.mat" + (".gz" if gz else "")
            atomic_write_bytes(folder / name, gzip.compress(data, mtime=0) if gz else data)
    return folder


def write_npz(
    path: str | os.PathLike,
    *,
    n_train: int = 40,
    n_test: int = 20,
    n_classes: int = 3,
    shape: tuple[int, ...] = (20, 24, 3),
    seed: int = 0,
) -> Path:
    """A Keras-convention .npz: x_* uint8 [N, H, W] or [N, H, W, C], y_* int64 [N]."""
    path = Path(path)
    arrays = {}
    for split, n, s in (("train", n_train, seed), ("test", n_test, seed + 10)):
        y = _labels(n, n_classes, s)
        c = shape[2] if len(shape) == 3 else 1
        x = pattern_images(y, c, shape[0], shape[1], s).transpose(0, 2, 3, 1)
        arrays[f"x_{split}"], arrays[f"y_{split}"] = (x if len(shape) == 3 else x[..., 0]), y
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def write_image_folder(
    root: str | os.PathLike,
    *,
    classes: tuple[str, ...] = ("cat", "dog", "fox"),
    per_class: int = 6,
    size: tuple[int, int] = (20, 24),
    mode: str = "RGB",
    split: bool = True,
    seed: int = 0,
) -> Path:
    """PNG files root/train/<class>/*.png and root/test/<class>/*.png (or root/<class>/ without `split`)."""
    from PIL import Image

    root = Path(root)
    channels = 1 if mode == "L" else 3
    parts = (("train", per_class), ("test", max(1, per_class // 2))) if split else (("", per_class),)
    for p, (part, n) in enumerate(parts):
        for k, name in enumerate(classes):
            folder = root / part / name if part else root / name
            folder.mkdir(parents=True, exist_ok=True)
            x = pattern_images(np.full(n, k), channels, size[0], size[1], seed + 100 * p + k)
            for i in range(n):
                arr = x[i, 0] if channels == 1 else x[i].transpose(1, 2, 0)
                Image.fromarray(arr).save(folder / f"{name}_{i:03d}.png")
    return root
