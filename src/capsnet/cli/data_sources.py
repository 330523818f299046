"""`capsnet data info|check` for the sources beyond MNIST-format IDX files: .npz, CIFAR, SVHN, smallNORB and image
folders. Used by `capsnet.cli.data`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ..data import cifar, folder, smallnorb, sources, svhn
from ..data.download import DATASETS, known_md5s, md5_file
from ..data.split import Dataset
from ..errors import DatasetError


def class_lines(ds: Dataset) -> list[str]:
    """One line per class: index, name, images per split."""
    rows = [(n, s) for n, s in (("train", ds.train), ("test", ds.test)) if s is not None]
    counts = {n: np.bincount(s.labels.numpy(), minlength=ds.n_classes) for n, s in rows}
    width = max(len(name) for name in ds.names)
    head = f"{'class':>5}  {'name':<{width}}  " + "  ".join(f"{n:>7}" for n, _ in rows)
    lines = [head]
    for k, name in enumerate(ds.names):
        lines.append(f"{k:>5}  {name:<{width}}  " + "  ".join(f"{counts[n][k]:>7}" for n, _ in rows))
    return lines


def files_of(path: Path, fmt: str) -> list[Path]:
    """The files that make up a set of format `fmt` at `path` (not the images of an image folder)."""
    if path.is_file():
        return [path]
    if fmt in ("cifar10", "cifar100"):
        base = cifar.data_folder(path, fmt)
        train, test, names = cifar.FILES[fmt]
        return [base / f for f in (*train, *test, names) if (base / f).is_file()]
    if fmt == "svhn":
        return [path / f for f in (*svhn.FILES, svhn.EXTRA) if (path / f).is_file()]
    if fmt == "smallnorb":
        return [p for s in smallnorb.PREFIX for part in ("dat", "cat", "info") if (p := smallnorb.find(path, s, part))]
    if fmt == "npz":
        return sorted(p for p in path.glob("*.npz") if p.is_file())
    return []


def folder_digest(files: list[Path], root: Path) -> str:
    """One MD5 for a class folder: over the sorted lines "relative path, file MD5", so it changes when any file is
    added, removed, renamed or edited."""
    h = hashlib.md5()
    for f in sorted(files):
        h.update(f"{f.relative_to(root).as_posix()} {md5_file(f)}\n".encode())
    return h.hexdigest()


def check_source(name: str, path: Path, fmt: str, *, strict: bool) -> bool:
    """Print an OK/FAIL line per file (size, MD5 and whether it is a published one) and one for the content
    (read by the format's reader, which checks its structure). Returns whether all is well."""
    all_ok = True
    if fmt == "folder":
        for part in folder.split_dirs(path):
            if part is not None:
                class_dirs = folder._class_dirs(part)
                n_files = sum(len(folder._images_in(d)) for d in class_dirs)
                print(f"OK    {part.name}/  {n_files} image files in {len(class_dirs)} class folders")
                for d in class_dirs:
                    images = folder._images_in(d)
                    print(f"OK    {part.name}/{d.name}/  {len(images)} image files, md5 {folder_digest(images, d)}")
    for f in files_of(path, fmt):
        digest = md5_file(f)
        known = known_md5s(f.name)
        if strict:
            known = {m: label for m, label in known.items() if label == name}
        table = {**DATASETS.get(name, {}).get("files", {}), **DATASETS.get(name, {}).get("optional", {})}
        msg = f"{f.stat().st_size} bytes, md5 {digest}"
        ok = True
        if digest in known:
            msg += f" = {known[digest]}"
        elif strict and f.name in table:
            ok = False
            msg += f" is not the published {table[f.name]}"
        else:
            msg += " (no published checksum for this file)" if strict else " (not a known file)"
        all_ok &= ok
        print(f"{'OK  ' if ok else 'FAIL'}  {f.name}  {msg}")
    try:
        ds = sources.load(path, fmt, name=name, source=str(path))
    except DatasetError as e:
        print(f"FAIL  content  {e}")
        return False
    shape = "×".join(map(str, ds.image_shape))
    train_text = f"train {len(ds.train)}, " if ds.train is not None else "no train split, "
    val_text = f"val {len(ds.val)}, " if ds.val is not None else ""
    print(f"OK    content  {fmt}: {train_text}{val_text}test {len(ds.test)}, images {shape}, {ds.n_classes} classes")
    return all_ok
