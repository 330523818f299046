"""Inference: test metrics of a model on a split (accuracy, per-class accuracy, confusion matrix), and predictions
for image files."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..data.datasets import load_dataset
from ..data.images import load_image
from ..data.split import Split
from ..errors import DatasetError
from ..models.pretrained import load_pretrained
from . import distributed as dist_utils
from .checkpoint import resolve_checkpoint


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
    """
    dist = dist or dist_utils.DistInfo()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    n_classes = model.config.n_classes
    images, labels = split.images[dist.rank :: dist.world_size], split.labels[dist.rank :: dist.world_size]
    confusion = torch.zeros(n_classes, n_classes, dtype=torch.float64)
    loss_sum = 0.0
    for start in range(0, len(labels), batch_size):
        x = images[start : start + batch_size].to(device).float().div_(255.0)
        y = labels[start : start + batch_size].to(device)
        out = model(x)
        loss, _ = model.loss(out, x, y)
        loss_sum += loss.item() * len(y)
        idx = y.cpu() * n_classes + out.predictions.cpu()
        confusion += torch.bincount(idx, minlength=n_classes * n_classes).view(n_classes, n_classes)
    model.train(was_training)
    flat = dist_utils.all_sum([loss_sum, *confusion.flatten().tolist()], dist, device)
    loss_sum, confusion = flat[0], torch.tensor(flat[1:], dtype=torch.float64).view(n_classes, n_classes)
    n = int(confusion.sum().item())
    totals = confusion.sum(dim=1)
    per_class = [(confusion[k, k] / totals[k]).item() if totals[k] > 0 else float("nan") for k in range(n_classes)]
    return {
        "accuracy": (confusion.diag().sum() / max(n, 1)).item(),
        "n": n,
        "loss": loss_sum / max(n, 1),
        "per_class": per_class,
        "confusion": confusion.long().tolist(),
    }


def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    dataset: str = "mnist-sample",
    data_dir: str | None = None,
    split: str = "test",
    batch_size: int = 250,
    device: str = "cpu",
) -> dict:
    """Load a run folder or save_pretrained folder and evaluate it on a data set split."""
    model = load_pretrained(resolve_checkpoint(checkpoint), map_location=device)
    data = load_dataset(dataset, data_dir=data_dir)
    chosen = data.test if split == "test" else data.train
    if chosen is None:
        raise DatasetError(f"{data.source}: has no {split} split")
    want = (model.config.in_channels, model.config.image_size, model.config.image_size)
    if tuple(chosen.images.shape[1:]) != want:
        got = "x".join(map(str, chosen.images.shape[1:]))
        raise DatasetError(f"{data.source}: images are {got}, the model expects {'x'.join(map(str, want))}")
    result = evaluate(model, chosen, batch_size=batch_size, device=device)
    result.update(checkpoint=str(checkpoint), dataset=data.name, split=split)
    return result


@torch.no_grad()
def predict(model: torch.nn.Module, images: list[str | Path]) -> list[dict]:
    cfg = model.config
    batch = torch.stack([load_image(p, size=cfg.image_size, channels=cfg.in_channels) for p in images])
    out = model.eval()(batch)
    return [
        {"image": str(p), "class": int(c), "lengths": [round(float(x), 6) for x in row]}
        for p, c, row in zip(images, out.predictions.tolist(), out.lengths.tolist())
    ]
