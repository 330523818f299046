"""`capsnet models`: every registered model (`capsnet train --model NAME`, `capsnet.create_model(NAME)`), with its
size, paper, intended data and the weights shipped for it (`--pretrained NAME:TAG`)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator


def register(subparsers) -> None:
    p = subparsers.add_parser("models")
    p.add_argument("--json", action="store_true", help="print one JSON object per model")
    p.set_defaults(func=run)


@contextlib.contextmanager
def _shapes_only() -> Iterator[None]:
    """Counting parameters needs their shapes only: torch.nn.init's in-place fills (`normal_`, `trunc_normal_`, ...)
    leave the tensors as allocated while the models are built, and are restored afterwards."""
    import torch

    fills = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in fills}
    try:
        for name in fills:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def model_rows() -> list[dict]:
    """One row per registered model, its parameters counted on the default (the paper's) configuration."""
    from ..models.hub import shipped_tags
    from ..models.registry import MODELS

    rows = []
    for name, cls in MODELS.items():
        with _shapes_only():
            model = cls()
        decoder = getattr(model, "decoder", None)
        total = sum(p.numel() for p in model.parameters())
        rows.append({
            "model": name,
            "parameters": total,
            "without_decoder": total - sum(p.numel() for p in decoder.parameters()) if decoder is not None else total,
            "paper": getattr(cls, "paper", "-"),
            "designed_for": getattr(cls, "designed_for", "-"),
            "default_lr": cls.default_lr,
            "aliases": MODELS.aliases(name),
            "weights": shipped_tags(name),
        })  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> int:
    rows = model_rows()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    width, paper = max(len(r["model"]) for r in rows), max(len(r["paper"]) for r in rows)
    designed = max(len(r["designed_for"]) for r in rows)
    print(f"{'model':<{width}}  {'parameters':>11}  {'no decoder':>11}  {'paper':<{paper}}  "
          f"{'designed for':<{designed}}  weights (--pretrained NAME:TAG)")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:<{width}}  {r['parameters']:>11,}  {r['without_decoder']:>11,}  {r['paper']:<{paper}}  "
            f"{r['designed_for']:<{designed}}  {', '.join(r['weights']) or '-'}"
        )
    return 0
