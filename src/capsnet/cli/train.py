"""`capsnet train`: flags generated from TrainConfig and every registered model's config, or a --config file.

A model option is one flag, `--field-name`, shared by the models whose configs have a field of that name (their
types must agree). A flag that the chosen `--model` does not take is an error, not silently ignored. `--model`
naming an installed plugin's model (capsnet.plugins) registers it before the flags are parsed and adds its options.

`--resume` continues the run in --out with the settings its config.json records: a flag (or --config key) given
again must agree with them unless it may change on resume (capsnet.training.record.MAY_CHANGE).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import types
import typing
from pathlib import Path
from typing import Any

from ..config import (
    add_dataclass_arguments,
    add_field_argument,
    dataclass_from_args,
    field_default,
    load_config_file,
)
from ..configs.base import DATA_FIELDS, MODEL_CONFIGS
from ..errors import ConfigError
from ..plugins import PluginError
from ..training.config import TrainConfig

# The parser reads the models' configs (capsnet.configs) and TrainConfig, all torch-free; training, the record of a
# run and the model registry are imported when the command runs.


@dataclasses.dataclass
class ModelOption:
    """One model flag: the field's type and, per model that takes it, (help text, default)."""

    name: str
    type: Any
    models: dict[str, tuple[str, Any]]


def model_options(configs: dict[str, type] | None = None) -> dict[str, ModelOption]:
    """The config fields (except those the data set fills in) of `configs` (model name -> config class; default:
    every model config of capsnet.configs, built-in or registered in this process), merged by name."""
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    options: dict[str, ModelOption] = {}
    for model_name, config_class in (MODEL_CONFIGS if configs is None else configs).items():
        hints = typing.get_type_hints(config_class)
        for f in dataclasses.fields(config_class):
            if f.name in DATA_FIELDS or not f.init:
                continue
            if f.name in train_fields:
                raise TypeError(f"{config_class.__name__}.{f.name} clashes with the TrainConfig field of that name")
            option = options.setdefault(f.name, ModelOption(f.name, hints[f.name], {}))
            if _flag_type(option.type) != _flag_type(hints[f.name]):
                other = ", ".join(option.models)
                raise TypeError(
                    f"field {f.name!r} is {hints[f.name]} in {config_class.__name__} but {option.type} "
                    f"in the config of {other}: one flag cannot take both"
                )
            option.models[model_name] = (f.metadata.get("help", ""), field_default(f))
    return options


def _flag_type(tp: Any) -> Any:
    """The type a flag parses for a field of type `tp`: `int | None` and `int` make the same flag."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return members[0] if len(members) == 1 else tp
    return tp


def _help(option: ModelOption) -> str:
    """`text (default: 9)` for one model; for several, each model's text (when they differ) and default."""
    (text, default), *others = option.models.values()
    if not others:
        return text if "(default" in text else f"{text} (default: {default})"
    if all(t == text for t, _ in others):
        return f"{text} (default {'; '.join(f'{m}: {d}' for m, (_, d) in option.models.items())})"
    return "; ".join(t if "(default" in t else f"{m}: {t} (default: {d})" for m, (t, d) in option.models.items())


def flags_of(model: str, config_class: type | None = None) -> list[str]:
    """The model flags that `--model MODEL` takes (a plugin's: those of its `config_class`)."""
    options = model_options(None if config_class is None else {model: config_class})
    return ["--" + name.replace("_", "-") for name, o in options.items() if model in o.models]


def register(subparsers) -> None:
    p = subparsers.add_parser("train")
    p.add_argument("--config", dest="config_file", help="YAML or JSON file of TrainConfig keys (+ 'model': {...})")
    add_dataclass_arguments(p, TrainConfig)
    groups: dict[tuple[str, ...], Any] = {}
    for option in model_options().values():
        takers = tuple(option.models)
        if takers not in groups:
            title = f"model options (--model {' or '.join(takers)})"
            groups[takers] = p.add_argument_group(title)
        add_field_argument(groups[takers], option.name, option.type, _help(option))
    p.prepare = add_plugin_model_flags
    p.set_defaults(func=run)


def add_plugin_model_flags(parser: argparse.ArgumentParser, args: list[str]) -> None:
    """`--model NAME` naming an installed plugin's model: register it (importing it) and add the fields of its config
    as flags, in place of the built-in models' flags of the same names. A plugin that cannot be loaded, or a field
    that clashes with a TrainConfig flag, is the parser's one-line error."""
    name = next((v for flag, v in itertools.pairwise(args) if flag == "--model"), None)
    name = next((a.split("=", 1)[1] for a in args if a.startswith("--model=")), name)
    if name is None or name in MODEL_CONFIGS:
        return
    from ..models.registry import MODELS

    try:
        model = MODELS.canonical(name)
        options = model_options({model: MODELS[model].config_class}) if model not in MODEL_CONFIGS else {}
    except PluginError as e:
        parser.error(str(e))
    except ConfigError:
        return  # an unknown name: TrainConfig reports it, with the known ones
    except TypeError as e:  # a field of its config has a TrainConfig flag's name
        parser.error(f"plugin model {name!r}: {e}")
    if options:
        parser.conflict_handler = "resolve"  # its fields replace the built-in models' flags of the same names
        group = parser.add_argument_group(f"model options (--model {model}, a plugin)")
        for option in options.values():
            add_field_argument(group, option.name, option.type, _help(option))
        parser.set_defaults(plugin_options=list(options))


def configs_from_args(args: argparse.Namespace) -> tuple[TrainConfig, Any]:
    """The TrainConfig and the chosen model's config: defaults, then the --config file, then the flags.

    A model flag (or a key under the file's `model:`) that the chosen model does not take is a ConfigError.
    """
    base = load_config_file(args.config_file) if args.config_file else {}
    model_base = base.pop("model", {}) or {}
    if not isinstance(model_base, dict):
        raise ConfigError(f"{args.config_file}: 'model' must be a mapping")
    from ..models.registry import MODELS

    config = dataclass_from_args(TrainConfig, args, base)
    config_class = MODELS[config.model].config_class
    takes = {f.name for f in dataclasses.fields(config_class)}
    for name in model_flags(args):
        if getattr(args, name, None) is not None and name not in takes:
            _reject(f"--{name.replace('_', '-')}", config.model, config_class)
    for key in model_base:
        if key not in takes:
            _reject(f"{args.config_file}: model key {key!r}", config.model, config_class)
    # The data set fills in the data fields (TrainConfig.image_size, a conversion, is not the model's image_size).
    model_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in DATA_FIELDS})
    return config, dataclass_from_args(config_class, model_args, model_base)


def given_model_options(args: argparse.Namespace, model_config: Any) -> dict[str, Any]:
    """The model options this command sets (its flags and the --config file's `model:` keys) with the values
    `configs_from_args` checked: what `train` is given, so that the model's defaults, on one's own data its
    own-data options (capsnet.training.build), fill in the rest."""
    base = load_config_file(args.config_file) if args.config_file else {}
    names = set(base.get("model") or {}) | {n for n in model_flags(args) if getattr(args, n, None) is not None}
    return {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.name in names}


def resumed_from_args(args: argparse.Namespace, run_dir: Path) -> tuple[TrainConfig, Any]:
    """The TrainConfig and model config of the run in `run_dir`, as it recorded them, with the flags (and --config
    keys) given now: each must agree with the record unless it may change on resume."""
    from ..training.record import resumed_configs

    base = load_config_file(args.config_file) if args.config_file else {}
    model_base = base.pop("model", {}) or {}
    if not isinstance(model_base, dict):
        raise ConfigError(f"{args.config_file}: 'model' must be a mapping")
    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig) if f.init}
    given = {**base, **{k: list(v) if isinstance(v, tuple) else v for k, v in flags.items() if v is not None}}
    options = {name: getattr(args, name, None) for name in model_flags(args)}
    model_given = {**model_base, **{k: v for k, v in options.items() if v is not None and k not in DATA_FIELDS}}
    return resumed_configs(run_dir, given, model_given, style="flag")


def _single_folder(dataset: str) -> bool:
    """Whether `dataset` is one image folder of classes with no test split (split by --test-fraction)."""
    from ..data import folder

    path = Path(dataset).expanduser()
    return path.is_dir() and folder.detect(path) and folder.split_dirs(path)[1] is None


def model_flags(args: argparse.Namespace) -> list[str]:
    """The names of the model flags the parser has: the models' of capsnet.configs, and a plugin model's."""
    return list(dict.fromkeys([*model_options(), *getattr(args, "plugin_options", [])]))


def _reject(what: str, model: str, config_class: type) -> None:
    plugin = None if model in MODEL_CONFIGS else config_class
    raise ConfigError(f"{what} is not an option of --model {model} (it takes: {', '.join(flags_of(model, plugin))})")


def run_folder(args: argparse.Namespace) -> Path:
    """The run folder the command names: --out, else the --config file's `out`, else TrainConfig's default."""
    if args.out is not None:
        return Path(args.out)
    out = load_config_file(args.config_file).get("out") if args.config_file else None
    if out is None:
        return Path(field_default(TrainConfig.__dataclass_fields__["out"]))
    if not isinstance(out, str):
        raise ConfigError(f"{args.config_file}: 'out' must be a folder name, got {out!r}")
    return Path(out)


def run(args: argparse.Namespace) -> int:
    from ..training.api import train
    from ..training.callbacks import describe_selection
    from ..training.checkpoint import STATE_NAME
    from ..training.record import read_record

    run_dir = run_folder(args)
    # Resuming a run: its own settings, and the flags given again.
    if args.resume and (run_dir / STATE_NAME).is_file() and read_record(run_dir) is not None:
        config, model_config = resumed_from_args(args, run_dir)
    else:  # the model options given, so that the rest are the model's own (on one's own data, its own-data options)
        config, model_config = configs_from_args(args)
        model_config = given_model_options(args, model_config)
    if args.val_fraction is not None and args.test_fraction is None and _single_folder(config.dataset):
        print(
            "capsnet train: --val-fraction now holds out validation images; a folder without a test split holds "
            f"out --test-fraction (default {config.test_fraction}) of each class for testing (deprecated "
            "meaning of --val-fraction)",
            file=sys.stderr,
        )
    result = train(config, model_config)
    if result.interrupted:
        return 128 + result.signal if result.signal else 130
    if result.is_main:
        chosen = describe_selection(result.test or {"selected_on": result.best.get("metric")})
        print(
            f"done: best/ is epoch {result.best.get('epoch')} (chosen on {chosen}), test accuracy "
            f"{result.best_test_acc:.4f}; outputs in {result.run_dir}/ (best/, last/, test.json, summary.csv, "
            "config.json)"
        )
    return 0
