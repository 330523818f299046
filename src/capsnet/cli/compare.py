"""`capsnet compare`: the paper's CapsNet with each of `--routings` and each of `--models` (built-in or installed
plugins), trained with the same data, budget and seeds, then measured alike (capsnet.experiments.compare).

The shared settings are `capsnet train`'s flags (SHARED; their help is TrainConfig's); every other setting is each
entry's own default. The parser is torch-free; the names are checked (plugins loaded) before anything trains.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

from ..config import add_field_argument, field_default, finite_float, parse_option
from ..configs.routings import fully_connected
from ..errors import ConfigError
from ..training.config import TrainConfig

# The TrainConfig fields every entry shares, as `capsnet train`'s flags.
SHARED = (
    "dataset",
    "data_dir",
    "epochs",
    "train_subset",
    "test_subset",
    "val_fraction",
    "batch_size",
    "device",
    "precision",
)
DEFAULT_OUT = "runs/compare"


def _names(text: str) -> list[str]:
    """ "a,b, c" -> ["a", "b", "c"]."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def _option(text: str) -> tuple[str, Any]:
    """`capsnet.config.parse_option`, as an argparse type."""
    try:
        return parse_option(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        description="Train the paper's CapsNet with each routing of --routings and each model of --models (built in "
        "or installed plugins) on the same data with the same epochs and seeds, each with its own defaults; then "
        "report each validation-chosen checkpoint's test accuracy, its accuracy on affine-transformed test images, "
        "parameters, training and inference img/s, peak memory and routing activity, as a Markdown table "
        "(OUT/compare.md) and rows of the results data (OUT/results.csv).",
    )
    p.add_argument(
        "--routings",
        type=_names,
        default=None,
        help=f"comma-separated --routing names for the paper's CapsNet: {', '.join(fully_connected())} or "
        "an installed plugin's (neither --routings nor --models: every built-in routing and every "
        "registered model)",
    )
    p.add_argument(
        "--models",
        type=_names,
        default=None,
        help="comma-separated --model names, each with its defaults: `capsnet models` lists them, "
        "installed plugins' included",
    )
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    group = p.add_argument_group("the settings every entry shares (as capsnet train's)")
    for name in SHARED:
        text = fields[name].metadata.get("help", "")
        if "(default" not in text:
            text = f"{text} (default: {field_default(fields[name])})"
        add_field_argument(group, name, hints[name], text)
    group.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[fields["seed"].default],
        metavar="SEED",
        help="seeds: each entry trains once per seed; the rows give each seed's test accuracy, their "
        f"mean and std (default: {fields['seed'].default})",
    )
    group.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a model config field (JSON value) for every entry whose config has it, e.g. "
        "--option conv_channels=64 (repeatable)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder of the runs and reports (default: {DEFAULT_OUT})")
    p.add_argument("--infer-batch", type=int, default=100, help="batch of the batched inference speed (default: 100)")
    p.add_argument(
        "--infer-seconds",
        type=finite_float,
        default=1.0,
        help="how long each inference speed is timed, at least three passes (default: 1)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..experiments.compare import TABLE_NAME, compare, entries, train_settings

    if args.infer_batch < 1:
        raise ConfigError(f"--infer-batch must be >= 1, got {args.infer_batch}")
    if args.infer_seconds <= 0:
        raise ConfigError(f"--infer-seconds must be > 0, got {args.infer_seconds}")
    settings = train_settings({name: getattr(args, name) for name in SHARED})
    found = entries(args.routings, args.models, dict(args.option))
    Path(args.out).mkdir(parents=True, exist_ok=True)  # (a path that cannot be a folder: one line, nothing trained)
    command = shlex.join(["capsnet", *sys.argv[1:]]) if sys.argv[1:2] == ["compare"] else "capsnet compare"
    print(
        f"capsnet compare: {len(found)} entries x {len(args.seed)} seeds: {', '.join(e.label for e in found)}",
        flush=True,
    )
    rows, failed = compare(
        found,
        settings=settings,
        seeds=args.seed,
        out=args.out,
        command=command,
        infer_batch=args.infer_batch,
        infer_seconds=args.infer_seconds,
        echo=lambda line: print(line, flush=True),
    )
    if rows:
        print("\n" + (Path(args.out) / TABLE_NAME).read_text(encoding="utf-8"))
    for line in failed:
        print(f"capsnet compare: {line}", file=sys.stderr)
    print(f"rows in {args.out}/results.csv, the table in {args.out}/compare.md")
    return 1 if failed else 0
