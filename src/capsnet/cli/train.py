"""`capsnet train`: flags generated from TrainConfig and CapsNetConfig, or a --config file."""

from __future__ import annotations

import argparse

from ..config import add_dataclass_arguments, dataclass_from_args, load_config_file
from ..errors import ConfigError
from ..models.capsnet import CapsNetConfig
from ..training.loop import DATA_FIELDS, TrainConfig, train


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a CapsNet (the paper's MNIST recipe by default)")
    p.add_argument("--config", dest="config_file", help="YAML or JSON file of TrainConfig keys (+ 'model': {...})")
    add_dataclass_arguments(p, TrainConfig)
    add_dataclass_arguments(p, CapsNetConfig, exclude=DATA_FIELDS)
    p.set_defaults(func=run)


def configs_from_args(args: argparse.Namespace) -> tuple[TrainConfig, CapsNetConfig]:
    base = load_config_file(args.config_file) if args.config_file else {}
    model_base = base.pop("model", {}) or {}
    if not isinstance(model_base, dict):
        raise ConfigError(f"{args.config_file}: 'model' must be a mapping")
    return dataclass_from_args(TrainConfig, args, base), dataclass_from_args(CapsNetConfig, args, model_base)


def run(args: argparse.Namespace) -> int:
    config, model_config = configs_from_args(args)
    result = train(config, model_config if config.model == "capsnet" else None)
    if result.interrupted:
        return 128 + result.signal if result.signal else 130
    if result.is_main:
        print(f"done: best test accuracy {result.best_test_acc:.4f}; outputs in {result.run_dir}/ "
              f"(best/, last/, summary.csv, config.json)")  # fmt: skip
    return 0
