"""The Task protocol: what the training loop trains on and how it scores, as batches (Batch); seeds for its batches.

A task supplies, for one epoch, the training batches (images, targets and any extra per-batch tensors), the
forward pass and loss for a batch, and the validation and test scores (capsnet.training.evaluator). The loop itself
(optimizer, checkpoints, resume, SIGTERM, torchrun, summary.csv, TensorBoard) is the same for every task:

- capsnet.training.classification.ClassificationTask: the paper's MNIST recipe (§4, §5): one digit per image,
  random shifts of up to 2 px. The default.
- capsnet.training.loader.LoaderTask: capsnet.fit's, on any Dataset or iterable of batches.
- capsnet.experiments.multimnist.MultiMNISTTask: two overlapping digits per image (§6).
- capsnet.experiments.affnist.ExpandedMNISTTask: digits placed at random on a 40×40 canvas, tested on affine
  transformed digits (§5.2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..models.recipe import InputRecipe
from . import distributed as dist_utils


@dataclass
class Batch:
    images: torch.Tensor  # float [B, C, H, W]: the model's input (its recipe applied), on the training device
    targets: torch.Tensor  # class indices [B] or multi-hot [B, n_classes]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # task-specific per-batch tensors


class Task:
    """Base class; subclasses set `name`, `in_channels`, `image_size`, `n_classes` and override the methods."""

    name: str = "task"
    in_channels: int = 1
    image_size: int | tuple[int, int] = 28  # (height, width) when not square
    n_classes: int = 10
    digits: bool = False  # whether the raw images are digit-style ink images (RecordedData.digits)
    recipe: InputRecipe = InputRecipe()  # how the batches turn raw images into the model's input (÷ 255)
    # Passes over the training data in one epoch (LoopConfig.epoch_repeats, set when the run opens), where the task
    # can repeat its data (`repeatable`); `own_data`: data of the user's own rather than a set with a recorded
    # recipe, whose epochs `epoch_repeats` unset lengthens to MIN_EPOCH_STEPS (capsnet.training.config).
    repeats: int = 1
    repeatable: bool = False
    own_data: bool = False
    notes: tuple[str, ...] = ()  # lines saying what the task chose for the user (said once, when the run opens)

    def model_fields(self) -> dict[str, Any]:
        """Model options that come from the data rather than from flags: the input's shape and classes, whether it
        is a digit set, and the values of the recipe the batches apply (capsnet.models.recipe)."""
        return {
            "in_channels": self.in_channels,
            "image_size": self.image_size,
            "n_classes": self.n_classes,
            "digits": self.digits,
            **self.recipe.fields(),
        }

    def num_batches(self, *, batch_size: int, world_size: int) -> int:
        raise NotImplementedError

    def batches(
        self,
        *,
        epoch: int,
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
        generator: torch.Generator,
        start: int = 0,
    ) -> Iterator[Batch]:
        """The batches `start`, ..., num_batches(...) - 1 of `epoch`; deterministic given (seed, epoch, rank) and
        the state of `generator`, which a resumed run restores (so skipped batches must not draw from it)."""
        raise NotImplementedError

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module whose forward the loop runs (and DistributedDataParallel wraps); by default the model."""
        return model

    def forward(self, module: nn.Module, batch: Batch):
        return module(batch.images, batch.targets)

    def loss(self, model: nn.Module, out, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to minimise, number of correctly classified examples in the batch): both tensors on the training
        device, so that the step never waits for the device (the loop sums them there). By default one class per
        image: the model's own loss, and its predictions against the targets."""
        loss, _ = model.loss(out, batch.images, batch.targets)  # type: ignore[operator]
        return loss, (out.predictions == batch.targets).sum()

    @property
    def has_val(self) -> bool:
        """Whether the task holds a validation split (the loop then chooses best/ on it, and reads the test split
        only at the end of the run)."""
        return False

    @property
    def has_test(self) -> bool:
        """Whether the task holds a test split (scored once, at the end; without validation, best/ is chosen on it)."""
        return True

    # Whether a run stopped mid-epoch resumes at the batch where it stopped (`batches(start=...)` skips the done
    # batches exactly); if not, a stop mid-epoch keeps the checkpoint of the last finished epoch instead.
    resumes_mid_epoch: bool = True

    def selection_note(self) -> str | None:
        """One line for the log when best/ is not chosen on validation data; None when it is."""
        if self.has_val:
            return None
        return (
            "capsnet: no validation split (--val-fraction 0, or a run made before validation splits): best/ is "
            "chosen on the test set, so its test accuracy is a maximum over epochs, not an estimate"
        )

    def init_batch(self, *, batch_size: int, seed: int, world_size: int, device: torch.device) -> Batch | None:
        """The batch a model's data-dependent initialisation sees: rank 0's first of epoch 0, which every rank
        computes alike from the seed (rank 0's augmentation seed too); None for an epoch without batches."""
        generator = torch.Generator(device=device).manual_seed(seed * 1009)  # as rank 0's augment_rng
        batches = self.batches(
            epoch=0, batch_size=batch_size, seed=seed, rank=0, world_size=world_size, device=device, generator=generator
        )
        return next(iter(batches), None)

    def evaluate(
        self, model: nn.Module, *, split: str = "test", batch_size: int, device: torch.device, dist: dist_utils.DistInfo
    ) -> dict:
        """Metrics on the "val" or "test" split; must hold "accuracy" and "loss"."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------- shared helpers
def mix_seed(*values: int) -> int:
    """One 63-bit seed from several integers (seed, epoch, batch, ...), well mixed by numpy's SeedSequence."""
    state = np.random.SeedSequence([int(v) & (2**63 - 1) for v in values]).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


def seeded_generator(device: torch.device, *values: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(mix_seed(*values))
