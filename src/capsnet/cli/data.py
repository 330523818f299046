"""`capsnet data info|check`: describe a data set, or verify its files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..data.download import BUNDLED, DATASETS
from ..errors import DatasetError

if TYPE_CHECKING:
    from ..data.split import Split


def register(subparsers: argparse._SubParsersAction) -> None:
    known = ", ".join([BUNDLED, *DATASETS])
    parser = subparsers.add_parser("data", description=__doc__)
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    info = sub.add_parser("info", help="image counts, sizes and class histograms per split")
    info.add_argument("name_or_dir", metavar="NAME_OR_DIR", help=f"a data folder or .npz file, or one of: {known}")
    info.add_argument("--data-dir", help="folder holding the IDX files (overrides NAME_OR_DIR's location)")
    info.add_argument("--no-download", dest="download", action="store_false", help="never download")
    info.set_defaults(func=cmd_info)

    check = sub.add_parser(
        "check", help="verify each file: IDX structure, counts and known MD5s (exit status 2 if any fails)"
    )
    check.add_argument("name_or_dir", metavar="NAME_OR_DIR", help=f"a data folder or .npz file, or one of: {known}")
    check.add_argument("--data-dir", help="folder holding the IDX files (overrides NAME_OR_DIR's location)")
    check.set_defaults(func=cmd_check)


def _histogram_table(rows: list[tuple[str, Split]], n_classes: int) -> str:

    header = ["split", "images", "size", *map(str, range(n_classes))]
    table = [header]
    for name, split in rows:
        counts = np.bincount(split.labels.numpy(), minlength=n_classes)
        size = "×".join(map(str, split.images.shape[1:]))
        table.append([name, str(len(split)), size, *map(str, counts)])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    from ..data.colour import colour_check
    from ..data.datasets import load_dataset
    from ..data.imageaug import OWN_KINDS, resolve_augment
    from .data_sources import class_lines

    ds = load_dataset(args.name_or_dir, data_dir=args.data_dir, download=args.download)
    rows = [(n, s) for n, s in (("train", ds.train), ("test", ds.test)) if s is not None]
    if ds.class_names or ds.n_classes > 10:  # a row per class, with its name
        print(f"{ds.name}  ({ds.source}, {ds.n_classes} classes)")
        print("  ".join(f"{n}: {len(s)} images" for n, s in rows) + "  of " + "×".join(map(str, ds.image_shape)))
        print("\n".join(class_lines(ds)))
    else:
        print(f"{ds.name}  ({ds.source}, {ds.n_classes} classes; columns 0..{ds.n_classes - 1}: images per class)")
        print(_histogram_table(rows, ds.n_classes))
    if ds.train is None:
        print("(test-only folder: no train split)")
    kind = ds.kind or "idx"
    colours = colour_check(ds.train) if kind in OWN_KINDS and ds.train is not None else None
    spec = resolve_augment("auto", kind, colours=colours)
    crop = f"; test images centre-cropped to {spec.crop[0]}x{spec.crop[1]}" if spec.crop else ""
    print(f"augmentation (default): {spec}{crop} (capsnet train --augment changes it)")
    if colours is not None:
        print(f"  colour: {colours.line()}, over the whole training split")
    md5s = _md5_lines(args)
    if md5s:
        print("files (MD5; `capsnet data check` compares them with the published ones):")
        print("\n".join(md5s))
    return 0


def _md5_lines(args: argparse.Namespace) -> list[str]:
    """`  <md5>  <file>` for each file of the data set (its IDX files, or the one .npz file)."""
    from ..data.datasets import resolve
    from ..data.download import md5_file
    from ..data.idx import find_files

    _, folder, _ = resolve(args.name_or_dir, data_dir=args.data_dir)
    if folder is None:
        return []
    files = find_files(folder) if folder.is_dir() else {folder.name: folder}
    return [f"  {md5_file(path)}  {path.name}" for path in files.values()]


def _check_file(path: Path, expected_md5: dict[str, str], strict: bool) -> tuple[bool, str, int | None]:
    """(ok, message, number of items) for one file."""
    from ..data.download import md5_file
    from ..data.idx import read_idx

    try:
        arr = read_idx(path)
    except DatasetError as e:
        return False, str(e).removeprefix(f"{path}: "), None
    shape = "×".join(map(str, arr.shape))
    msg = f"{shape} {arr.dtype.name}"
    ok = True
    if path.suffix == ".gz":
        digest = md5_file(path)
        if digest in expected_md5:
            msg += f", md5 {digest} = {expected_md5[digest]}"
        elif strict:
            ok = False
            msg += f", md5 {digest} is not the known one ({', '.join(expected_md5) or 'none known'})"
        else:
            msg += f", md5 {digest} (not a known file)"
    else:
        msg += ", md5 not checked (uncompressed; known checksums are of the .gz files)"
    return ok, msg, int(arr.shape[0])


def cmd_check(args: argparse.Namespace) -> int:
    from ..data import sources
    from ..data.datasets import resolve
    from ..data.download import cache_root, known_md5s
    from ..data.idx import find_files
    from .data_sources import check_source

    name, folder, source = resolve(args.name_or_dir, data_dir=args.data_dir)
    if folder is None:
        raise DatasetError(
            f"{name} is not downloaded; expected it in {cache_root() / name} "
            f"(run something that loads it, or pass --data-dir)"
        )
    files = find_files(folder) if folder.is_dir() else {}
    # Known sets must match their published checksums; other folders are only compared for info.
    by_name = args.data_dir is None and not Path(args.name_or_dir).expanduser().exists()
    strict = by_name and (name == BUNDLED or name in DATASETS)
    if not files:
        fmt = sources.detect(folder)  # DatasetError naming the formats looked for, if none
        print(f"{name}  ({source}, {fmt})")
        return _finish(check_source(name, folder, fmt, strict=strict), folder)
    print(f"{name}  ({source})")
    all_ok, counts = True, {}
    for base, path in files.items():
        known = known_md5s(path.name)
        if strict:
            wanted = {BUNDLED} if name == BUNDLED else {name, f"{name} (Debian package)"}
            known = {m: label for m, label in known.items() if label in wanted}
        ok, msg, n = _check_file(path, known, strict)
        counts[base] = n
        all_ok &= ok
        print(f"{'OK  ' if ok else 'FAIL'}  {path.name}  {msg}")
    for split in ("train", "t10k"):
        img, lab = f"{split}-images-idx3-ubyte", f"{split}-labels-idx1-ubyte"
        if (img in files) != (lab in files):
            all_ok = False
            print(f"FAIL  {img if img not in files else lab}[.gz]  missing (its pair is present)")
        elif counts.get(img) is not None and counts.get(lab) is not None and counts[img] != counts[lab]:
            all_ok = False
            print(f"FAIL  {split} split  {counts[img]} images but {counts[lab]} labels")
    if "t10k-images-idx3-ubyte" not in files and "t10k-labels-idx1-ubyte" not in files:
        all_ok = False
        print("FAIL  t10k pair  missing: every data set needs a test split")
    return _finish(all_ok, folder)


def _finish(all_ok: bool, folder: Path) -> int:
    if all_ok:
        print("all files OK")
        return 0
    print(f"capsnet data: error: problems found in {folder} (the FAIL lines above)", file=sys.stderr)
    return 2  # bad input, as for every other error
