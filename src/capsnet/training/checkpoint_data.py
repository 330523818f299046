"""Which data a checkpoint is scored on: the data set its run recorded, checked against the model, in words."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..data.datasets import load_dataset, resolve
from ..data.folder import class_names as folder_classes
from ..data.sources import detect as detect_format
from ..data.split import Dataset, Split
from ..errors import DatasetError
from ..models.hub import is_ref, read_card, resolve_ref
from ..models.inputs import image_hw
from .checkpoint import checkpoint_info
from .evaluator import input_config
from .selection import SELECTED_ON


def check_split(model: torch.nn.Module, split: Split, *, source: str) -> None:
    """DatasetError unless `split` fits `model`: images [N, in_channels, H, W] of the model's input size, or of the
    size it recorded before its training crops (`source_size`; centre-cropped by `evaluate`), labels in
    [0, n_classes). `source` names the data in the message. A model without such a config: labels >= 0 only."""
    cfg: Any = input_config(model)
    if cfg is None:
        if len(split) and int(split.labels.min()) < 0:
            raise DatasetError(f"{source}: labels must be class indices >= 0, got {int(split.labels.min())}")
        return
    want = (cfg.in_channels, *image_hw(cfg.image_size))
    got_shape = tuple(split.images.shape[1:])
    uncropped = (cfg.in_channels, *getattr(cfg, "source_size", ()))
    if got_shape not in (want, uncropped):
        got = "x".join(map(str, split.images.shape[1:]))
        raise DatasetError(f"{source}: images are {got}, the model expects {'x'.join(map(str, want))}")
    if len(split) and (int(split.labels.min()) < 0 or int(split.labels.max()) >= cfg.n_classes):
        top = int(split.labels.max())
        raise DatasetError(f"{source}: labels go up to {top}, the model has {cfg.n_classes} classes")


def data_conversions(cfg: Any, where: str | None, data: Dataset) -> list[str]:
    """The documented conversions an image folder's reader applied to fit the model (grey to RGB, RGB to grey as
    `--image-channels 1` trains, a resize to its size), in words. Other readers convert nothing."""
    from ..data.folder import detect, native_shape

    root = Path(where) if where is not None else None
    if root is None or not root.is_dir() or not detect(root):
        return []
    native = native_shape(root)
    if native is None:
        return []
    c, h, w = native
    notes = []
    if c == 3 and cfg.in_channels == 1:  # (as `capsnet train --image-channels 1` reads a colour folder)
        notes.append("RGB images converted to greyscale (Pillow's L), as training with --image-channels 1 reads them")
    if c == 1 and cfg.in_channels == 3:
        notes.append("greyscale images converted to RGB")
    size = tuple(data.test.images.shape[-2:])
    if (h, w) != size:
        notes.append(f"images resized from {h}x{w} to {size[0]}x{size[1]}, the size the model reads")
    return notes


def scored(folder: Path) -> dict[str, Any]:
    """Which checkpoint `folder` is and how it was chosen, from the record its training run left in it."""
    info = checkpoint_info(folder) or {}
    return {"folder": str(folder), **info}


def describe_scored(entry: dict[str, Any]) -> str:
    """One line: the folder, its epoch, and how it was chosen (validation, or the test set for older runs)."""
    text = entry["folder"]
    if "epoch" in entry:
        text += f" (epoch {entry['epoch']}"
        if entry.get("view") == "best":
            selected = str(entry.get("selected_on", ""))
            text += f", chosen on {SELECTED_ON.get(selected, '?')} {entry.get('value', float('nan')):.4f}"
            if entry.get("weights") == "ema":
                text += ", the moving average's weights"
            if selected.startswith("test_"):
                text += ": its test figure is a maximum over epochs"
        elif entry.get("view") == "last":
            text += ", the run's last checkpoint"
        text += ")"
    elif entry["folder"].endswith("best"):
        text += " (chosen on test accuracy by a run made before validation splits: a maximum over epochs)"
    return text


def checkpoint_data(
    model: torch.nn.Module,
    checkpoints: list[str | os.PathLike],
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
    n_classes: int | None = None,
) -> Dataset:
    """The data set to score `model` (loaded from `checkpoints`) on: `dataset` and/or `data_dir` when given, else
    what the checkpoints record (`recorded_data`; they must agree), loaded with the conversion the model
    recorded (image folders: its size before crops and its channels; a single folder's held-out share).

    With `n_classes`, data of another class count is a DatasetError (a class count is never converted): an image
    folder's is found from its class folders, before any image is decoded (or cached)."""
    records = [recorded_data(c) for c in checkpoints]
    record = records[0]
    if dataset is None and data_dir is not None:  # the folder given, named as the run named it
        dataset = record["dataset"] if record is not None else data_dir
    if dataset is None:
        if record is None:
            raise DatasetError(
                f"{checkpoints[0]}: records no training data (a save_pretrained folder outside its run folder, or "
                "a run of capsnet.fit, whose data came from Python); pass --dataset"
            )
        same = ("dataset", "data_dir", "test_fraction")
        if any(r is None or any(r[k] != record[k] for k in same) for r in records[1:]):
            raise DatasetError("the checkpoints were trained on different data; pass --dataset")
        dataset, data_dir = record["dataset"], record["data_dir"]
    cfg: Any = model.config
    size = tuple(getattr(cfg, "source_size", ())) or image_hw(cfg.image_size)
    fraction = record.get("test_fraction") if record else None
    options = {"test_fraction": fraction} if fraction is not None else {}
    if n_classes is not None:
        _, root, source = resolve(dataset, data_dir=data_dir)
        if root is not None and root.is_dir() and detect_format(root) == "folder":
            _check_class_count(source, len(folder_classes(root)), n_classes)
    data = load_dataset(dataset, data_dir=data_dir, image_size=size, channels=cfg.in_channels, **options)
    if n_classes is not None:
        _check_class_count(data.source, data.n_classes, n_classes)
    return data


def _check_class_count(source: str, found: int, n_classes: int) -> None:
    if found != n_classes:
        raise DatasetError(
            f"{source}: {found} classes, the model has {n_classes} (a class count is never converted; fine-tune: "
            "create_model(name, pretrained=..., n_classes=K), then fit)"
        )


def recorded_data(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The data `checkpoint` was trained on, as recorded: {"dataset", "data_dir", "test_fraction"} from the training
    run's config.json (`checkpoint` is the run folder, or its best/ or last/), or from the card.json of shipped
    weights; None when nothing records it."""
    path = Path(checkpoint).expanduser()
    if isinstance(checkpoint, str) and is_ref(checkpoint):
        path = resolve_ref(checkpoint)
    runs = [path, path.parent] if path.name in ("best", "last") else [path]
    for run in runs:
        train = _run_train_config(run / "config.json")
        if train is not None:
            return {k: train.get(k) for k in ("dataset", "data_dir", "test_fraction", "test_subset")}
    card = read_card(path) if path.is_dir() else None
    if card is not None:
        return {"dataset": card["dataset"], "data_dir": None, "test_fraction": None, "test_subset": None}
    return None


def _run_train_config(path: Path) -> dict | None:
    """The "train" section of a run's config.json (with a "dataset" string), or None."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    train = meta.get("train") if isinstance(meta, dict) else None
    return train if isinstance(train, dict) and isinstance(train.get("dataset"), str) else None
