"""`capsnet convert FORMAT WEIGHTS --out DIR`: published weights as a capsnet save_pretrained folder.

The formats are those of `capsnet.models.converters.CONVERTERS`, each a subcommand with its own options
(`capsnet convert FORMAT --help`). The folder loads with `capsnet.load_pretrained(DIR)` and works with
`capsnet evaluate --checkpoint DIR` and `capsnet predict --checkpoint DIR`.
"""

from __future__ import annotations

import argparse

from ..models.converters import CONVERTERS, convert, converter_module


def register(subparsers) -> None:
    listing = "; ".join(f"{name}: {c.description}" for name, c in CONVERTERS.items())
    p = subparsers.add_parser(
        "convert",
        description=f"Convert published weights into a capsnet save_pretrained folder. Formats: {listing}.",
    )
    formats = p.add_subparsers(dest="format", metavar="FORMAT", title="formats")
    formats.required = True
    for name, c in CONVERTERS.items():
        q = formats.add_parser(name, help=c.description, description=c.description)
        q.add_argument("weights", metavar="WEIGHTS", help="the file to convert")
        q.add_argument("--out", required=True, help="folder to write config.json and model.safetensors into")
        q.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
        converter_module(name).add_arguments(q)
        q.set_defaults(func=run, converter_options=_own_options(q))


def _own_options(parser: argparse.ArgumentParser) -> list[str]:
    """The destinations of a format's own options (those its module added)."""
    common = {"help", "weights", "out", "overwrite"}
    return [a.dest for a in parser._actions if a.dest not in common]


def run(args: argparse.Namespace) -> int:
    options = {k: getattr(args, k) for k in args.converter_options if getattr(args, k) is not None}
    model = convert(args.format, args.weights, args.out, overwrite=args.overwrite, **options)
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{args.weights}: {type(model).__name__} ({n:,} parameters, {cfg.in_channels}×{cfg.image_size}×"
        f"{cfg.image_size} inputs, {cfg.n_classes} classes) -> {args.out}/"
    )
    return 0
