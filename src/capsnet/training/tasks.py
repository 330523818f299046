"""Training tasks: what the training loop in :mod:`capsnet.training` trains on, and how it scores.

A task supplies, for one epoch, the training batches (images, targets and any extra per-batch tensors), the
forward pass and loss for a batch, and the test evaluation. The loop itself (optimizer, checkpoints, resume,
SIGTERM, torchrun, summary.csv, TensorBoard) is the same for every task:

- :class:`ClassificationTask`: the paper's MNIST recipe (§4, §5): one digit per image, random shifts of up to
  2 px. The default.
- :class:`capsnet.experiments.multimnist.MultiMNISTTask`: two overlapping digits per image (§6).
- :class:`capsnet.experiments.affnist.ExpandedMNISTTask`: digits placed at random on a 40×40 canvas, tested on affine
  transformed digits (§5.2).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data.augment import random_shift
from ..data.batching import iterate_batches, num_batches
from ..data.datasets import load_dataset
from ..data.split import Split
from ..errors import DatasetError
from . import distributed as dist_utils
from .evaluate import evaluate


@dataclass
class Batch:
    images: torch.Tensor  # float [B, C, H, W] in [0, 1], on the training device
    targets: torch.Tensor  # class indices [B] or multi-hot [B, n_classes]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # task-specific per-batch tensors


class Task:
    """Base class; subclasses set `name`, `in_channels`, `image_size`, `n_classes` and override the methods."""

    name: str = "task"
    in_channels: int = 1
    image_size: int = 28
    n_classes: int = 10

    def model_fields(self) -> dict[str, int]:
        """Model options that come from the data rather than from flags."""
        return {"in_channels": self.in_channels, "image_size": self.image_size, "n_classes": self.n_classes}

    def num_batches(self, *, batch_size: int, world_size: int) -> int:
        raise NotImplementedError

    def batches(
        self, *, epoch: int, batch_size: int, seed: int, rank: int, world_size: int, device: torch.device,
        generator: torch.Generator, start: int = 0,
    ) -> Iterator[Batch]:  # fmt: skip
        """The batches `start`, ..., num_batches(...) - 1 of `epoch`; deterministic given (seed, epoch, rank) and
        the state of `generator`, which a resumed run restores (so skipped batches must not draw from it)."""
        raise NotImplementedError

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module whose forward the loop runs (and DistributedDataParallel wraps); by default the model."""
        return model

    def forward(self, module: nn.Module, batch: Batch):
        return module(batch.images, batch.targets)

    def loss(self, model: nn.Module, out, batch: Batch) -> tuple[torch.Tensor, float]:
        """(loss to minimise, number of correctly classified examples in the batch)."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, *, batch_size: int, device: torch.device, dist: dist_utils.DistInfo) -> dict:
        """Test metrics; must hold "accuracy" and "loss"."""
        raise NotImplementedError


def subset(split: Split, n: int | None) -> Split:
    return split if n is None else Split(split.images[:n], split.labels[:n])


class ClassificationTask(Task):
    """One digit per image, labels [B]; the paper's shift augmentation (§5: up to 2 px, zero padded)."""

    name = "classification"

    def __init__(self, *, train: Split, test: Split, n_classes: int = 10, shift: int = 2, source: str = "data"):
        _, channels, height, width = train.images.shape
        if height != width:
            raise DatasetError(f"{source}: images are {height}x{width}; CapsNet expects square images")
        self.train, self.test, self.shift = train, test, shift
        self.in_channels, self.image_size, self.n_classes = channels, height, n_classes

    @classmethod
    def from_config(cls, config) -> ClassificationTask:
        """Build from a TrainConfig's dataset, data_dir, train_subset, test_subset and shift."""
        data = load_dataset(config.dataset, data_dir=config.data_dir)
        if data.train is None:
            raise DatasetError(f"{data.source}: holds only a test split; training needs the train-* files too")
        return cls(
            train=subset(data.train, config.train_subset), test=subset(data.test, config.test_subset),
            n_classes=data.n_classes, shift=config.shift, source=data.source,
        )  # fmt: skip

    def num_batches(self, *, batch_size: int, world_size: int) -> int:
        return num_batches(len(self.train), batch_size=batch_size, world_size=world_size)

    def batches(self, *, epoch, batch_size, seed, rank, world_size, device, generator, start=0) -> Iterator[Batch]:
        it = iterate_batches(
            self.train, batch_size=batch_size, shuffle=True, seed=seed, epoch=epoch, rank=rank,
            world_size=world_size, device=device,
        )  # fmt: skip
        # Skipped batches (a resumed epoch) draw no random numbers: the generator state was restored instead.
        for images, labels in itertools.islice(it, start, None):
            yield Batch(self.augment(images, generator), labels)

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The training augmentation: the paper's random shift (§5)."""
        return random_shift(images, self.shift, generator=generator)

    def loss(self, model, out, batch) -> tuple[torch.Tensor, float]:
        loss, _ = model.loss(out, batch.images, batch.targets)
        return loss, (out.predictions == batch.targets).sum().item()

    def evaluate(self, model, *, batch_size, device, dist) -> dict:
        return evaluate(model, self.test, batch_size=batch_size, device=device, dist=dist)


# --------------------------------------------------------------------------------------- shared helpers
def mix_seed(*values: int) -> int:
    """One 63-bit seed from several integers (seed, epoch, batch, ...), well mixed by numpy's SeedSequence."""
    state = np.random.SeedSequence([int(v) & (2**63 - 1) for v in values]).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


def seeded_generator(device: torch.device, *values: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(mix_seed(*values))


def place_on_canvas(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: int) -> torch.Tensor:
    """Paste each image x[b] [C, h, w] with its top-left corner at (top[b], left[b]) of a black size×size canvas.

    x [B, C, h, w]; top, left int [B] (parts falling outside the canvas are cut off). Returns [B, C, size, size].
    One gather for the whole batch: canvas pixel (y, x) reads image pixel (y - top, x - left), zero outside.
    """
    b = x.shape[0]
    pad = size  # enough for any offset in [-size, size]
    padded = F.pad(x, (pad, pad + size, pad, pad + size)).permute(0, 2, 3, 1)  # [B, h+3s, w+3s, C]
    top, left = top.to(x.device).long(), left.to(x.device).long()
    rows = torch.arange(size, device=x.device)[None, :] - top[:, None] + pad  # [B, size]
    cols = torch.arange(size, device=x.device)[None, :] - left[:, None] + pad  # [B, size]
    batch = torch.arange(b, device=x.device)[:, None, None]
    return padded[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


def evaluate_batches(model, batches, *, score, device: torch.device, dist: dist_utils.DistInfo) -> dict:
    """Loss and accuracy over `batches` (this rank's (Batch) share), summed over ranks.

    `score(model, batch) -> (loss tensor, n correct)`; returns {"accuracy", "loss", "n"}.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            loss, n_correct = score(model, batch)
            n = batch.images.shape[0]
            loss_sum, correct, count = loss_sum + loss.item() * n, correct + n_correct, count + n
    model.train(was_training)
    loss_sum, correct, count = dist_utils.all_sum([loss_sum, correct, count], dist, device)
    return {"accuracy": correct / max(count, 1), "loss": loss_sum / max(count, 1), "n": int(count)}
