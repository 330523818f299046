"""`capsnet models`: every registered model (`capsnet train --model NAME`, `capsnet.create_model(NAME)`), with its
size, paper, intended data and the weights shipped for it (`--pretrained NAME:TAG`)."""

from __future__ import annotations

import argparse
import json

from ..models.hub import shipped_tags
from ..models.registry import MODELS


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "models", help="list the models: parameters, paper, data they were designed for, shipped weights"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per model")
    p.set_defaults(func=run)


def model_rows() -> list[dict]:
    """One row per registered model, its parameters counted on the default (the paper's) configuration."""
    rows = []
    for name, cls in MODELS.items():
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
