"""The run's config.json: written at every start, read back so that a resumed run keeps its own settings.

Rank 0 writes RUN/config.json at every start: {"train": the TrainConfig (or capsnet.fit's FitConfig), "model": the
model's config, "task": ..., ...}. Resuming (`capsnet train --out RUN --resume`, `capsnet.training.resume(RUN)`,
`capsnet.fit(..., resume=True)`):

- a setting not given is the run's own (a None field of a config is "not given");
- a setting given again must agree with the record, unless it is one of MAY_CHANGE: how long to train (epochs and
  --stop-at-val-acc; the stretched learning-rate schedule follows, see capsnet.training.state.restore) and how and
  where the run executes (device, precision, compile, progress, TensorBoard, workers, the evaluation batch size,
  where the files are);
- anything else (data set, subsets, augmentation, validation split, batch size, learning rate, seed, model and its
  options) given with another value is a ConfigError naming the setting and both values.

The record carries `format_version` (RECORD_FORMAT) from now on; a record without one is this format's first
version (runs written before it was added resume as they are). A record of a later format is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .._version import __version__
from ..config import from_dict, to_dict
from ..errors import CheckpointError, ConfigError, RunFolderError
from ..fileio import atomic_write_json
from ..models.registry import MODELS
from .checkpoint import STATE_NAME
from .config import FitConfig, TrainConfig
from .selection import DEFAULT_MONITOR

# What a resumed run may change. lr_decay and lr_end reshape the schedule from the resumed epoch on, as epochs does.
MAY_CHANGE = (
    "epochs",
    "stop_at_val_acc",
    "lr_decay",
    "lr_end",
    "eval_batch_size",
    "device",
    "precision",
    "channels_last",
    "compile",
    "cuda_graphs",
    "cudnn_benchmark",
    "progress",
    "tensorboard",
    "workers",
    "data_dir",
    "out",
    "overwrite",
    "resume",
)
FROM_STATE = ("val_fraction", "val_seed")  # a TrainConfig's split is the one its record says (resumed_settings)
SCHEDULE = ("lr_decay", "lr_end")  # one setting, given either way: one given now replaces the run's other
RECORD_MARK = "capsnet_version"  # the capsnet that wrote the record
RECORD_FORMAT = 1  # config.json's format_version: the next change of its meaning keys its reading on it
FIT_TASK = "loader"  # the task name of a run made by capsnet.fit
FIT_RUN = "a run made by capsnet.fit (its data came from Python); resume it with capsnet.fit(..., resume=True)"


def write_record(run_dir: Path, config: Any, model_config: Any, task: Any) -> None:
    """Rank 0's config.json at a run's start: {"train": `config`, "model": `model_config` (None: a module of one's
    own), "task": its name, RECORD_MARK: the version, and what the task records (e.g. the augmentation "auto"
    resolved to)}."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model = to_dict(model_config) if model_config is not None else None
    meta = {
        "format_version": RECORD_FORMAT,
        "train": to_dict(config),
        "model": model,
        "task": task.name,
        RECORD_MARK: __version__,
        **getattr(task, "recorded", {}),
    }
    atomic_write_json(run_dir / "config.json", meta)


def read_record(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's config.json, or None when there is none; CheckpointError for one that cannot be read."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("train"), dict):
        raise CheckpointError(f"{path}: not the config.json of a training run (no 'train' settings)")
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > RECORD_FORMAT:
        raise CheckpointError(
            f"{path}: format_version {version!r}, written by a newer capsnet (this one reads "
            f"{RECORD_FORMAT}); upgrade capsnet"
        )
    return meta


def recorded_settings(meta: dict[str, Any], config_class: type) -> dict[str, Any]:
    """The record's "train" settings that `config_class` has (in today's meaning of each key)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return {k: v for k, v in meta["train"].items() if k in names}


def without_other_schedule(recorded: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`recorded` without its schedule settings when `given` sets the schedule (either of SCHEDULE)."""
    if any(given.get(k) is not None for k in SCHEDULE):
        return {k: v for k, v in recorded.items() if k not in SCHEDULE}
    return recorded


def recorded_model_name(saved: dict[str, Any], run_dir: Path) -> str | None:
    """The model a run trained: what its state.pt says, else its config.json; None if neither says."""
    name = saved.get("model_type")
    if isinstance(name, str):
        return name
    try:
        meta = read_record(run_dir)
    except CheckpointError:
        return None
    model = meta["train"].get("model") if meta else None
    return model if isinstance(model, str) else None


def same(a: Any, b: Any) -> bool:
    """Whether two settings are equal as config.json records them (a tuple as a list)."""
    return json.loads(json.dumps(a)) == json.loads(json.dumps(b))  # (tuples as lists)


def _canonical(key: str, value: Any) -> Any:
    if key == "model" and isinstance(value, str) and value in MODELS:
        return MODELS.canonical(value)
    return value


def conflicts(given: dict[str, Any], recorded: dict[str, Any], *, skip=()) -> list[tuple[str, Any, Any]]:
    """(key, given, recorded) for each given setting that disagrees with the record and may not change."""
    found = []
    for key, value in given.items():
        if key in MAY_CHANGE or key in skip or key not in recorded or value is None:
            continue
        if not same(_canonical(key, value), _canonical(key, recorded[key])):
            found.append((key, value, recorded[key]))
    return found


def say(key: str, value: Any, style: str) -> str:
    """A setting as the user gave it: `--batch-size 16` (style "flag") or `batch_size=16` (style "keyword")."""
    if style == "keyword":
        return f"{key}={value!r}"
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + key.replace("_", "-")
    if isinstance(value, (list, tuple)):
        return f"{flag} {' '.join(map(str, value))}"
    return f"{flag} {value}"


def conflict_error(
    run_dir: Path, found: list[tuple[str, Any, Any]], *, style: str, config_class: type, hint: str = ""
) -> ConfigError:
    """The one line for settings that disagree with the run's record, with what `config_class` (TrainConfig for
    `capsnet train`, FitConfig for capsnet.fit) lets a resumed run change."""
    key, given, recorded = found[0]
    others = f" (also {', '.join(say(k, v, style) for k, v, _ in found[1:])})" if found[1:] else ""
    fields = {f.name for f in dataclasses.fields(config_class) if not f.metadata.get("internal")}
    names = [k for k in MAY_CHANGE[:-3] if k in fields]  # (not out, overwrite, resume: which run, and what to do)
    changeable = ", ".join(k if style == "keyword" else "--" + k.replace("_", "-") for k in names)
    return ConfigError(
        f"{run_dir}: {say(key, given, style)} conflicts with the run's recorded {say(key, recorded, style)}{others}; "
        f"a resumed run keeps its settings, only these may change: {changeable}{hint}"
    )


def check_recorded(config: TrainConfig | FitConfig, run_dir: Path, *, only=None) -> None:
    """ConfigError unless `config` (a resumed run's, every field as given) agrees with the run's record (`only`:
    just those keys). A TrainConfig's val_fraction and val_seed are those of its state.pt and not checked here."""
    meta = read_record(run_dir)
    if meta is None:
        return
    fit = isinstance(config, FitConfig)
    if (meta.get("task") == FIT_TASK) != fit:
        raise ConfigError(
            f"{run_dir}: a run made by capsnet train; resume it with capsnet train --resume"
            if fit
            else f"{run_dir}: {FIT_RUN}"
        )
    given = to_dict(config)
    if only is not None:
        given = {k: v for k, v in given.items() if k in only}
    found = conflicts(given, recorded_settings(meta, type(config)), skip=() if fit else FROM_STATE)
    if found:
        hint = "" if fit else "; capsnet.training.resume(OUT, **changes) takes the run's own settings"
        raise conflict_error(run_dir, found, style="keyword", config_class=type(config), hint=hint)


def fill_unset(config: Any, run_dir: Path) -> Any:
    """`config` with its unset (None) fields taken from the run's record (e.g. its batch size)."""
    meta = read_record(run_dir)
    if meta is None:
        return config
    recorded = without_other_schedule(recorded_settings(meta, type(config)), to_dict(config))
    fills = {k: v for k, v in recorded.items() if getattr(config, k) is None and v is not None}
    if not fills:
        return config
    return from_dict(type(config), {**to_dict(config), **fills}, what=f"{run_dir}/config.json")


def resumed_configs(
    run_dir: str | Path, given: dict[str, Any], model_given: dict[str, Any] | None = None, *, style: str = "keyword"
) -> tuple[TrainConfig, Any]:
    """The TrainConfig and model config of the run in `run_dir` resumed with `given` settings (TrainConfig keys) and
    `model_given` model options: the run's record, with `given`; ConfigError for a setting that may not change."""
    run_dir = Path(run_dir)
    meta = read_record(run_dir)
    if meta is None:
        raise CheckpointError(f"{run_dir}: no config.json, so the run's settings are unknown")
    if meta.get("task") == FIT_TASK:
        raise ConfigError(f"{run_dir}: {FIT_RUN}")
    recorded = recorded_settings(meta, TrainConfig)
    unknown = sorted(set(given) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} (TrainConfig fields or model options)")
    found = conflicts(given, recorded)
    if found:  # (before the model's config: another --model is the conflict to name)
        raise conflict_error(run_dir, found, style=style, config_class=TrainConfig)
    kept = {k: v for k, v in given.items() if v is not None}
    recorded = without_other_schedule(recorded, kept)
    config = from_dict(
        TrainConfig, {**recorded, **kept, "out": str(run_dir), "resume": True}, what=f"{run_dir}/config.json"
    )
    model_class = MODELS[config.model]
    saved: dict[str, Any] = meta["model"] if isinstance(meta.get("model"), dict) else {}
    model_config: Any = from_dict(
        model_class.config_class, {**model_class.saved_defaults, **saved}, what=f"{run_dir}/config.json model"
    )
    options = {f.name for f in dataclasses.fields(model_config) if f.init}
    for key, value in (model_given or {}).items():
        if key not in options:
            raise ConfigError(f"{run_dir}: {say(key, value, style)} is not an option of the run's model {config.model}")
        if value is not None and not same(value, getattr(model_config, key)):
            found.append((key, value, to_dict(model_config)[key]))
    if found:
        raise conflict_error(run_dir, found, style=style, config_class=TrainConfig)
    return config, model_config


def split_changes(changes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword changes to a resumed run as (TrainConfig settings, model options)."""
    names = set(TrainConfig.__dataclass_fields__)
    return {k: v for k, v in changes.items() if k in names}, {k: v for k, v in changes.items() if k not in names}


__all__ = ["MAY_CHANGE", "check_recorded", "fill_unset", "read_record", "resumed_configs", "split_changes"]


def resumed_settings(config: Any, *, flag: str) -> Any:
    """The settings to train with, as far as the record decides them: resuming, the run's own for each unset (None)
    field, checked against its record, with the validation split it recorded; a monitor unset is the default."""
    run_dir = Path(config.out)
    if config.resume:
        if not (run_dir / STATE_NAME).is_file():
            raise RunFolderError(f"{flag}: {run_dir} holds no {STATE_NAME} to continue from")
        config = fill_unset(config, run_dir)  # e.g. the batch size the run was made with, not the device default
        check_recorded(config, run_dir)  # before any data is read
        if isinstance(config, TrainConfig):
            config = resumed_validation(config, read_record(run_dir))
    if config.monitor is None:
        config = dataclasses.replace(config, monitor=DEFAULT_MONITOR)
    return config


def resumed_validation(config: TrainConfig, meta: dict[str, Any] | None) -> TrainConfig:
    """The TrainConfig with the validation split the resumed run recorded (val_fraction and val_seed). A run made
    before validation splits chose best/ on the test set, and keeps doing so."""
    recorded = (meta or {}).get("validation")
    if not isinstance(recorded, dict):
        return dataclasses.replace(config, val_fraction=0.0)
    fraction = recorded.get("fraction", 0.0 if recorded.get("source") == "none" else config.val_fraction)
    return dataclasses.replace(config, val_fraction=fraction, val_seed=recorded.get("seed", config.val_seed))
