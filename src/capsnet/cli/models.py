"""`capsnet models`: every registered model (`capsnet train --model NAME`, `capsnet.create_model(NAME)`), with its
size, paper, intended data and the weights shipped for it (`--pretrained NAME:TAG`); then every routing of the
routing registry (`capsnet train --routing NAME`). Installed plugins' models and routings are loaded and listed
with the distribution that provides them; one that fails to load is a warning line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator

from ..configs.routings import ROUTINGS, routing_names, routing_record
from ..errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser("models")
    p.add_argument("--json", action="store_true", help="print one JSON object per model (with --routings: routing)")
    p.add_argument(
        "--routings",
        action="store_true",
        dest="only_routings",
        help="list only the routings (`capsnet train --routing NAME`)",
    )
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


def model_rows(failed: list[str] | None = None) -> list[dict]:
    """One row per registered model (installed plugins' too; the lines of those that fail to load are added to
    `failed`), its parameters counted on the default (the paper's) configuration."""
    from ..models.hub import shipped_tags
    from ..models.registry import MODELS
    from ..training.config import min_epoch_steps, own_data_options

    problems = MODELS.load_plugins()
    if failed is not None:
        failed += problems
    rows = []
    for name, cls in MODELS.items():
        with _shapes_only():
            model = cls()
        decoder = getattr(model, "decoder", None)
        total = sum(p.numel() for p in model.parameters())
        rows.append(
            {
                "model": name,
                "parameters": total,
                "without_decoder": total - sum(p.numel() for p in decoder.parameters())
                if decoder is not None
                else total,
                "paper": getattr(cls, "paper", "-"),
                "designed_for": getattr(cls, "designed_for", "-"),
                "default_lr": cls.default_lr,
                "own_data_epoch_steps": min_epoch_steps(cls),
                "own_data_options": own_data_options(cls),
                "aliases": MODELS.aliases(name),
                "weights": shipped_tags(name),
                "plugin": MODELS.plugin(name),
            }
        )
    return rows


def routing_rows(failed: list[str] | None = None) -> list[dict]:
    """One row per `--routing` option, the installed plugins' loaded (lines of those that fail go to `failed`)."""
    rows = []
    for name in routing_names():
        try:
            r = routing_record(name)
        except ConfigError as e:
            if failed is not None:
                failed.append(str(e))
            continue
        rows.append(
            {
                "routing": name,
                "paper": r.paper,
                "iterations": r.iterations,
                "activations": r.activations,
                "fast_paths": list(r.fast_paths),
                "models": list(r.models),
                "plugin": r.plugin,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    failed: list[str] = []
    rows = [] if args.only_routings else model_rows(failed)
    routings = routing_rows(failed)
    for line in failed:
        print(f"capsnet models: warning: {line}", file=sys.stderr)
    if args.json:
        for row in routings if args.only_routings else rows:
            print(json.dumps(row))
        return 0
    if args.only_routings:
        print_routings(routings)
        return 0
    width, paper = max(len(r["model"]) for r in rows), max(len(r["paper"]) for r in rows)
    designed = max(len(r["designed_for"]) for r in rows)
    print(
        f"{'model':<{width}}  {'parameters':>11}  {'no decoder':>11}  {'paper':<{paper}}  "
        f"{'designed for':<{designed}}  weights (--pretrained NAME:TAG)"
    )
    for r in rows:
        print(
            f"{r['model']:<{width}}  {r['parameters']:>11,}  {r['without_decoder']:>11,}  {r['paper']:<{paper}}  "
            f"{r['designed_for']:<{designed}}  {', '.join(r['weights']) or '-'}"
            + (f"  (plugin: {r['plugin']})" if r["plugin"] else "")
        )
    print()
    print_routings(routings)
    return 0


def print_routings(rows: list[dict]) -> None:
    """The routings as a table: name, paper, default iterations, activations, fast paths, where it comes from."""
    width, paper = max(len(r["routing"]) for r in rows), max(len(r["paper"]) for r in rows)
    fast = max(len("fast paths"), *(len(", ".join(r["fast_paths"])) for r in rows))
    print(f"{'routing':<{width}}  {'paper':<{paper}}  iterations  activations  {'fast paths':<{fast}}  source")
    for r in rows:
        source = f"plugin: {r['plugin']}" if r["plugin"] else "built in"
        print(
            f"{r['routing']:<{width}}  {r['paper']:<{paper}}  {r['iterations'] or '-':>10}  "
            f"{'yes' if r['activations'] else 'no':>11}  {', '.join(r['fast_paths']) or '-':<{fast}}  {source}"
        )
    for grid in [r for r in ROUTINGS.values() if r.layer is None]:
        models = ", ".join(grid.models)
        print(f"({grid.name}: {grid.method}, {grid.paper}: routes capsule grids, part of --model {models})")
