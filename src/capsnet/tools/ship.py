"""Ship a finished training run as weights inside the package (capsnet.models.hub): its validation-chosen checkpoint,
RUN/best/, with a card that records how it was made and what it scores.

    python tools/ship_weights.py RUN --tag TAG      # -> src/capsnet/models/weights/<model>/<tag>/
    python tools/ship_weights.py --halve MODEL:TAG  # store shipped weights again as float16 (the check below)

The card's `command` is the `capsnet train` command that the run's config.json describes (every setting that differs
from its default), `val_accuracy` and `epoch` the validation figure that chose best/, `test_accuracy` that
checkpoint's test figure as the run measured it once at its end (test.json), and `data_md5` the MD5 of each file of
the data set it was trained on. tests/test_shipped.py scores every shipped folder again and must find the same figures.

`--half` stores the weights as float16 (half the bytes; loading casts them back to float32). It ships only where
the rounding changes no prediction on the data set's validation and test images (those tests/test_shipped.py
scores), and the card records the count compared (`storage`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..config import field_default
from ..data.datasets import load_dataset, resolve
from ..data.download import md5_file
from ..data.idx import find_files
from ..data.scaling import channel_stats
from ..data.split import Split, stratified_holdout
from ..errors import CheckpointError, ConfigError
from ..models.hub import read_card, save_shipped, weights_root
from ..models.inputs import DATA_FIELDS
from ..models.pretrained import WEIGHTS_NAME, load_pretrained
from ..models.recipe import model_input
from ..models.registry import MODELS
from ..training.checkpoint import TEST_NAME, checkpoint_info
from ..training.config import TrainConfig
from ..training.evaluator import standardizes_channels

# TrainConfig settings that do not change what a run learns, left out of the recorded command.
NOT_IN_COMMAND = ("device", "progress", "tensorboard", "resume", "strict")


def _flag(name: str, value: Any, default: Any) -> list[str]:
    """The command-line words that set field `name` to `value` ([] when it is the default)."""
    value = list(value) if isinstance(value, tuple) else value
    default = list(default) if isinstance(default, tuple) else default
    if value == default:
        return []
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def train_command(record: dict[str, Any]) -> str:
    """The `capsnet train` command that a run's config.json (`record`) describes: --model, then every TrainConfig and
    model setting that differs from its default (the data fields come from the data set, and are left out)."""
    train = record["train"]
    words = ["capsnet", "train", "--model", train["model"]]
    for f in dataclasses.fields(TrainConfig):
        if f.name in train and f.name not in (*NOT_IN_COMMAND, "model"):
            value = _portable(train[f.name]) if f.name == "out" else train[f.name]
            words += _flag(f.name, value, field_default(f))
    model_class = MODELS[MODELS.canonical(train["model"])]
    saved = record.get("model") or {}
    for f in dataclasses.fields(model_class.config_class):
        if f.name in saved and f.name not in DATA_FIELDS and f.init:
            words += _flag(f.name, saved[f.name], field_default(f))
    return shlex.join(words)


def _portable(out: Any) -> Any:
    """An absolute run folder as runs/ and its last two parts (a card names no folder of the machine that trained
    it); a relative one as it is."""
    path = Path(str(out))
    return str(Path("runs", *path.parts[-2:])) if path.is_absolute() else out


def data_md5s(dataset: str, data_dir: str | None) -> dict[str, str]:
    """File name -> MD5 of each file of a data set (its IDX files, or the one .npz file); ConfigError for data that
    has no such fixed set of files (an image folder), or that is not on this machine."""
    _, where, source = resolve(dataset, data_dir=data_dir)
    if where is None:
        raise ConfigError(f"{dataset}: not on this machine, so its files' MD5s cannot be recorded")
    if where.is_file():
        return {where.name: md5_file(where)}
    files = find_files(where)
    if not files:
        raise ConfigError(f"{source}: ships only from IDX or .npz data, whose files the card can name")
    return {path.name: md5_file(path) for path in files.values()}


def ship_card(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The card (capsnet.models.hub.CARD_FIELDS) of a finished run's best/ checkpoint."""
    run = Path(run_dir)
    try:
        record = json.loads((run / "config.json").read_text(encoding="utf-8"))
        tested = json.loads((run / TEST_NAME).read_text(encoding="utf-8"))
        best_meta = json.loads((run / "best" / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{run}: not a finished run ({Path(e.filename).name} is missing)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{run}: unreadable run record ({e})") from None
    if not str(tested.get("selected_on")).startswith("val_"):
        raise CheckpointError(f"{run}: best/ was not chosen on validation data, so it does not ship")
    try:
        train, best = record["train"], tested["best"]
        card = {
            "command": train_command(record),
            "dataset": train["dataset"],
            "val_accuracy": best["val_acc"],
            "test_accuracy": best["accuracy"],
            "epoch": best["epoch"],
            "capsnet_version": best_meta.get("capsnet_version", "unknown"),
            "validation": record.get("validation", {}),
            "test_n": best["n"],
        }
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{run}: its config.json or {TEST_NAME} lacks what a card records ({e!r})") from None
    return {**card, "data_md5": data_md5s(train["dataset"], train.get("data_dir"))}


def choose_run(runs: list[str | os.PathLike]) -> Path:
    """Of finished runs (one per seed), the one whose best/ has the lowest validation loss (its test.json's
    best.val_loss; the test figures are not read); CheckpointError if a run has none."""
    losses: dict[Path, float] = {}
    for run in map(Path, runs):
        try:
            best = json.loads((run / TEST_NAME).read_text(encoding="utf-8"))["best"]
            losses[run] = float(best["val_loss"])
        except FileNotFoundError:
            raise CheckpointError(f"{run}: not a finished run ({TEST_NAME} is missing)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{run}: its {TEST_NAME} gives no validation loss of best/ ({e!r})") from None
    if not losses:
        raise CheckpointError("no run to choose from")
    return min(losses, key=lambda run: losses[run])


def ship_run(
    run_dir: str | os.PathLike, *, tag: str, root: str | os.PathLike | None = None, half: bool = False
) -> Path:
    """Write run_dir/best/ as shipped weights MODEL:TAG (root: capsnet.models.hub.weights_root() by default), with
    its `ship_card`; returns the folder written. `half`: stored as float16, refused (CheckpointError) where that
    changes a prediction on the run's validation or test images."""
    card = ship_card(run_dir)
    best = Path(run_dir) / "best"
    model = load_pretrained(best)
    name = MODELS.canonical(model.model_type)
    if half:
        card["storage"] = half_storage(model, card)
    return save_shipped(model, name=name, tag=tag, card=card, root=root, metadata=checkpoint_info(best))


def halve_shipped(name: str, tag: str, *, root: str | os.PathLike | None = None) -> Path:
    """Store the shipped weights NAME:TAG again as float16, under `half_storage`'s check (its card gains `storage`);
    returns the folder. A folder already in float16 is left as it is."""
    folder = Path(root if root is not None else weights_root()) / MODELS.canonical(name) / tag
    card = read_card(folder)
    if card is None:
        raise CheckpointError(f"{folder}: no shipped weights with a card there")
    if card.get("storage", {}).get("dtype") == "float16":
        return folder
    model = load_pretrained(folder)
    card["storage"] = half_storage(model, card)
    return save_shipped(model, name=name, tag=tag, card=card, root=root, metadata=checkpoint_info(folder))


def half_storage(model: Any, card: dict[str, Any]) -> dict[str, Any]:
    """Cast `model`'s floating-point weights to float16 in place, after checking that the float16 copy, loaded back
    as float32 the way from_pretrained loads it, predicts every validation and test image of the card's data as the
    float32 weights do; returns the card's `storage` record."""
    data = load_dataset(card["dataset"])
    validation = card["validation"]
    if validation.get("source") == "official" or data.train is None:
        held = data.val
    else:
        held = stratified_holdout(data.train, validation["fraction"], seed=validation["seed"])[1]
    if held is None or data.test is None:
        raise CheckpointError(f"{card['dataset']}: no validation or test images to compare float16 storage on")
    splits: dict[str, Split] = {"validation": held, "test": data.test}
    before = {k: predictions(model, split) for k, split in splits.items()}
    with tempfile.TemporaryDirectory(prefix="capsnet-half-") as tmp:
        rounded = load_pretrained(_half_copy(model, Path(tmp)))
    changed = {k: int((predictions(rounded, split) != before[k]).sum()) for k, split in splits.items()}
    if any(changed.values()):
        counts = ", ".join(f"{n} of {len(splits[k])} {k} images" for k, n in changed.items())
        raise CheckpointError(f"float16 storage changes the prediction of {counts}: ship it without --half")
    model.half()  # (save_pretrained then writes float16 tensors)
    return {"dtype": "float16", "compared": {k: len(split) for k, split in splits.items()}, "changed": 0}


def _half_copy(model: Any, folder: Path) -> Path:
    """`model` saved into `folder` with float16 weights (for load_pretrained)."""
    model.save_pretrained(folder)
    state = {k: v.half() if v.is_floating_point() else v for k, v in load_file(str(folder / WEIGHTS_NAME)).items()}
    if not all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point()):
        raise CheckpointError("a weight is beyond float16's range: ship it without --half")
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return folder


@torch.no_grad()
def predictions(model: Any, split: Split, *, batch_size: int = 250) -> torch.Tensor:
    """The class `model` predicts for each image of `split`, through its input recipe  [N]."""
    model.eval()
    stats = channel_stats(split) if standardizes_channels(model) else None
    out = [
        model(model_input(model, split.images[i : i + batch_size], stats=stats)).predictions.long()
        for i in range(0, len(split), batch_size)
    ]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


__all__ = ["choose_run", "data_md5s", "half_storage", "predictions", "ship_card", "ship_run", "train_command"]
