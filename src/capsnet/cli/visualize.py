"""`capsnet visualize`: every figure of a checkpoint, as PNG files."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .checkpoints import add_model_arguments, model_paths


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "visualize",
        description="Write reconstructions.png, perturbation.png, routing.png, curves.png and confusion.png "
        "for a checkpoint (a training run folder or a save_pretrained folder).",
    )
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="data set name or folder (default: the one the checkpoint was trained on)",
    )
    src.add_argument("--data-dir", metavar="DIR", help="folder holding MNIST-format IDX files")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the PNG files into")
    p.add_argument("--seed", type=int, default=0, help="seed choosing the displayed test digits (default: 0)")
    p.add_argument("--n", type=_positive, default=10, help="digits in reconstructions.png (default: 10)")
    p.add_argument(
        "--limit",
        type=_positive,
        default=None,
        metavar="N",
        help="confusion matrix over the first N test images only (default: all)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 or auto (default: cpu)")
    p.set_defaults(func=run)


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def run(args: argparse.Namespace) -> int:
    from ..viz.figures import visualize

    (checkpoint,) = model_paths(args)
    written = visualize(
        checkpoint,
        args.out,
        dataset=args.dataset,
        data_dir=args.data_dir,
        seed=args.seed,
        n=args.n,
        limit=args.limit,
        device=args.device,
        log=lambda msg: print(msg, file=sys.stderr),
    )
    for path in written.values():
        print(path)
    names = _class_names(checkpoint)
    if names:  # the names the model recorded from its training data (the figures show class indices)
        print("classes: " + "  ".join(f"{k}={name}" for k, name in enumerate(names)))
    return 0


def _class_names(checkpoint: str | os.PathLike) -> list[str]:
    from ..models.pretrained import CONFIG_NAME
    from ..training.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(checkpoint)
    try:
        meta = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = meta.get("config", {}).get("class_names") if isinstance(meta, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []
