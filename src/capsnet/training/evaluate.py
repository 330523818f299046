"""Inference: test metrics of a model on a split (accuracy, per-class accuracy, confusion matrix), and predictions
for image files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import torch

from ..data.datasets import load_dataset, resolve
from ..data.folder import class_names as folder_classes
from ..data.imageaug import center_crop
from ..data.images import image_hw as image_file_hw
from ..data.images import load_image, load_image_resized
from ..data.mnist_form import IN_WORDS
from ..data.scaling import channel_stats
from ..data.sources import detect as detect_format
from ..data.split import Dataset, Split
from ..errors import ConfigError, DatasetError
from ..models.hub import is_ref, read_card, resolve_ref
from ..models.inputs import image_hw
from ..models.pretrained import load_pretrained
from ..models.recipe import InputRecipe, model_input, recipe_of
from . import distributed as dist_utils
from .checkpoint import checkpoint_info, resolve_checkpoint
from .config import upgrade_train_dict
from .ensemble import Ensemble
from .hardware import resolve_device
from .monitor import SELECTED_ON


def _input_config(model: torch.nn.Module) -> Any:
    """The model's config when it records its input (a capsnet model's), else None (a module of one's own)."""
    cfg = getattr(model, "config", None)
    return cfg if all(hasattr(cfg, k) for k in ("in_channels", "image_size", "n_classes")) else None


def check_split(model: torch.nn.Module, split: Split, *, source: str) -> None:
    """DatasetError unless `split` fits `model`: images [N, in_channels, H, W] of the model's input size, or of the
    size it recorded before its training crops (`source_size`; centre-cropped by :func:`evaluate`), labels in
    [0, n_classes). `source` names the data in the message. A model without such a config: labels >= 0 only."""
    cfg: Any = _input_config(model)
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


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    split: Split,
    *,
    batch_size: int = 250,
    device: str | torch.device = "cpu",
    dist: dist_utils.DistInfo | None = None,
) -> dict:
    """Test-time metrics of `model` on `split` (the decoder sees the longest capsule, as at test time).

    Returns accuracy, n, loss (mean training loss on these images), per_class accuracy and the confusion
    matrix (rows: true class, columns: predicted). Under torchrun each rank takes every world_size-th
    image and the counts are summed over ranks.

    Every batch reaches the model through its input recipe (:func:`capsnet.models.recipe.model_input`: centre crop,
    scaling; a model that standardizes each channel, with `split`'s own statistics). A module of one's own
    (capsnet.fit's protocol) without a recipe gets the images ÷ 255, and the classes are those of the labels
    (0 ... max label); a prediction outside them counts as wrong (and in no column of the confusion matrix).
    """
    dist = dist or dist_utils.DistInfo()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    cfg = _input_config(model)
    n_classes: int = cfg.n_classes if cfg is not None else int(split.labels.max()) + 1 if len(split) else 1
    images, labels = split.images[dist.rank :: dist.world_size], split.labels[dist.rank :: dist.world_size]
    stats = channel_stats(split) if standardizes_channels(model) else None  # (the split's own, as the authors')
    # The loss sum and the confusion counts stay on the device, read once at the end. Column n_classes of each row
    # counts the predictions outside [0, n_classes) (none for a capsnet model).
    width = n_classes + 1
    sums = torch.zeros(1 + n_classes * width, dtype=torch.float64, device=device)  # [loss sum, confusion...]
    for start in range(0, len(labels), batch_size):
        x = model_input(model, images[start : start + batch_size].to(device), stats=stats)
        y = labels[start : start + batch_size].to(device)
        out = model(x)
        loss, _ = cast(Any, model).loss(out, x, y)
        sums[0] += loss.detach().double() * len(y)
        predicted = out.predictions.long()
        predicted = torch.where((predicted >= 0) & (predicted < n_classes), predicted, n_classes)
        cell = 1 + y * width + predicted  # confusion[true, predicted], flattened after the loss slot
        sums.index_add_(0, cell, torch.ones_like(cell, dtype=torch.float64))
    model.train(was_training)
    flat = dist_utils.all_sum_tensor(sums, dist).cpu()
    loss_sum, counts = flat[0].item(), flat[1:].view(n_classes, width)
    confusion = counts[:, :n_classes]
    n = int(counts.sum().item())
    totals = counts.sum(dim=1)
    per_class = [(confusion[k, k] / totals[k]).item() if totals[k] > 0 else float("nan") for k in range(n_classes)]
    return {
        "accuracy": (confusion.diag().sum() / max(n, 1)).item(),
        "n": n,
        "loss": loss_sum / max(n, 1),
        "per_class": per_class,
        "confusion": confusion.long().tolist(),
    }


def evaluate_checkpoint(
    checkpoint: str | os.PathLike | list[str | os.PathLike],
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
    split: str = "test",
    batch_size: int = 250,
    device: str = "cpu",
) -> dict:
    """Load a run folder or save_pretrained folder and evaluate it on a data set split. Several checkpoints are
    evaluated as one :class:`capsnet.training.ensemble.Ensemble` (their capsule lengths averaged).

    The data set defaults to the one the checkpoint records (:func:`recorded_data`); `dataset` / `data_dir` choose
    another. Image folders are converted as for training: to the size the model recorded (before its crops) and
    channels. `device`: cpu, cuda, cuda:K or auto."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    paths = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    folders = [resolve_checkpoint(c) for c in paths]
    models = [load_pretrained(f, map_location=resolve_device(device)) for f in folders]
    model = models[0] if len(models) == 1 else Ensemble(models)
    cfg: Any = model.config
    data = checkpoint_data(model, paths, dataset=dataset, data_dir=data_dir, n_classes=cfg.n_classes)
    chosen = data.test if split == "test" else data.train
    if chosen is None:
        raise DatasetError(f"{data.source}: has no {split} split")
    conversions = data_conversions(cfg, data.source, data)
    record = recorded_data(paths[0]) if dataset is None and data_dir is None else None
    n = record.get("test_subset") if record is not None and split == "test" else None
    if n is not None:  # the subset the run's test.json scored
        chosen = Split(chosen.images[:n], chosen.labels[:n], chosen.channel_stats)
        conversions.append(f"the first {n} test images, as the run scored (its --test-subset)")
    check_split(model, chosen, source=data.source)
    result = evaluate(model, chosen, batch_size=batch_size, device=resolve_device(device))
    result["conversions"] = conversions
    result.update(checkpoint=str(paths[0]) if len(paths) == 1 else [str(p) for p in paths], dataset=data.name,
                  split=split, class_names=[class_name(cfg, k) for k in range(cfg.n_classes)],
                  scored=[scored(f) for f in folders])  # fmt: skip
    return result


def standardizes_channels(model: torch.nn.Module) -> bool:
    """Whether `model` (or a member of an ensemble) standardizes each channel with the scored split's statistics."""
    return any(getattr(getattr(m, "config", None), "channel_standardize", False) for m in model.modules())


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
    what the checkpoints record (:func:`recorded_data`; they must agree), loaded with the conversion the model
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
            train = upgrade_train_dict(train)  # a run made before validation splits named test_fraction otherwise
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


def fit_to_model(x: torch.Tensor, cfg) -> torch.Tensor:
    """Centre-crop images [B, C, H, W] larger than the model's input to its size (the test-time counterpart of
    training on random crops); images of the model's size pass unchanged."""
    h, w = image_hw(cfg.image_size)
    return x if tuple(x.shape[-2:]) == (h, w) else center_crop(x, (h, w))


def prepare_image(path: str | Path, cfg: Any) -> tuple[torch.Tensor, str]:
    """One image file as raw input [C, H, W] in [0, 1] for the model's recipe, and the conversion applied in words.

    A model trained on digit-style images (`digits`) gets MNIST's form: an image of its input size with a dark
    background is taken as it is; any other (a photo of ink on paper, say) goes through LeCun et al.'s MNIST
    procedure (:func:`capsnet.data.mnist_form.mnist_form`). Any other model gets the image converted (L or RGB) and
    resized as the image-folder reader converts training images, to its size before cropping (the recipe then
    centre-crops it)."""
    recipe = cfg if isinstance(cfg, InputRecipe) else InputRecipe.from_config(cfg)  # (a model config, or a recipe)
    assert recipe.size is not None and recipe.channels is not None
    (h, w), native = recipe.size, image_file_hw(path)
    if recipe.digits:
        if h != w:
            raise DatasetError(f"{path}: digit preprocessing needs a square model input, not {h}x{w}")
        if native == (h, w):
            x = load_image_resized(path, size=(h, w), channels=recipe.channels)
            border = torch.cat([x[:, 0], x[:, -1], x[:, :, 0], x[:, :, -1]], dim=-1)
            if border.mean() <= 0.5:
                return x, f"digit-style, taken as it is ({h}x{w}, dark background)"
        return load_image(path, size=h, channels=recipe.channels), f"digit-style: {IN_WORDS}"
    size = recipe.raw_size or (h, w)
    x = load_image_resized(path, size=size, channels=recipe.channels)
    what = "as it is" if native == size else f"resized from {native[0]}x{native[1]} to {size[0]}x{size[1]}"
    return x, what + (f", centre-cropped to {h}x{w}" if size != (h, w) else "")


def class_name(cfg, k: int) -> str:
    """Class k's name as the model recorded it from its training data, else str(k)."""
    names = getattr(cfg, "class_names", ())
    return names[k] if k < len(names) else str(k)


@torch.no_grad()
def predict(model: torch.nn.Module, images: list[str | Path]) -> list[dict]:
    """The class of each image file, its capsule lengths and the conversion applied (:func:`prepare_image`); the
    model's recipe then makes its input (a standardizing model: its training split's recorded statistics)."""
    batch, conversions = image_files_input(model, images)
    out = model.eval()(batch)
    return [
        {"image": str(p), "class": int(c), "name": class_name(model.config, int(c)),
         "lengths": [round(float(x), 6) for x in row], "conversion": how}
        for p, how, c, row in zip(images, conversions, out.predictions.tolist(), out.lengths.tolist())
    ]  # fmt: skip


def image_files_input(model: torch.nn.Module, images: list[str | Path]) -> tuple[torch.Tensor, list[str]]:
    """Image files as `model`'s input batch [B, C, H, W] on its device (:func:`prepare_image`, then the model's
    recipe; a standardizing model: its training split's recorded statistics), and each file's conversion in words.
    Every path that feeds image files to a model (predict, explore) calls this."""
    device = next(model.parameters()).device
    for member in model.modules():  # single images need a standardizing model's recorded training statistics
        if getattr(getattr(member, "config", None), "channel_standardize", False):
            InputRecipe.from_config(member.config).statistics()
    prepared = [prepare_image(p, recipe_of(model)) for p in images]
    return model_input(model, torch.stack([x for x, _ in prepared]).to(device)), [how for _, how in prepared]
