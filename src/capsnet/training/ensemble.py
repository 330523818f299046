"""Several trained models as one: the average of their class probabilities (capsule lengths).

The paper's CIFAR-10 result (§7, 10.6% error) is "an ensemble of 7 models", each trained with the same setup;
`capsnet evaluate --checkpoint RUN1 --checkpoint RUN2 ...` evaluates such an ensemble with :class:`Ensemble`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.inputs import image_hw
from ..models.recipe import InputRecipe, Stats, recipe_of
from ..nn.losses import MarginLoss


class EnsembleOutput(NamedTuple):
    """Mirrors :class:`capsnet.CapsNetOutput`: the averaged lengths and their argmax."""

    capsules: None
    lengths: torch.Tensor  # mean over the members of |v_j| (or a baseline's softmax)  [B, n_classes]
    predictions: torch.Tensor  # argmax  [B]
    reconstructions: None
    coupling: None


class Ensemble(nn.Module):
    """Averages the class probabilities of `models`, which must read the same raw images (channels, size, the size
    before cropping, digit-style or not) and have the same classes. Each member gets the raw images through its own
    input recipe (its scaling may differ): :meth:`prepare_input` makes one input per member [M, B, C, H, W], which
    forward takes (raw images [B, C, H, W] too). `config` is the first member's (what evaluate() reads)."""

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        if not models:
            raise CheckpointError("an ensemble needs at least one model")
        first: Any = models[0].config
        for k, m in enumerate(models[1:], start=2):
            cfg: Any = m.config
            for what in ("in_channels", "n_classes", "class_names", "source_size", "digits"):
                a, b = getattr(first, what, None), getattr(cfg, what, None)
                if a != b:
                    raise CheckpointError(f"checkpoint {k} has {what} {b}, the first has {a}: not one ensemble")
            if image_hw(cfg.image_size) != image_hw(first.image_size):
                raise CheckpointError(f"checkpoint {k} takes {cfg.image_size} images, the first {first.image_size}")
        self.members = nn.ModuleList(models)
        self.config = first
        self.margin_loss = MarginLoss(first.n_classes)

    @property
    def input_recipe(self) -> InputRecipe:
        """The raw images every member reads (its shape and classes); the values are each member's own."""
        return dataclasses.replace(recipe_of(self.members[0]), divisor=255.0, channel_standardize=False, mean=(),
                                   std=())  # fmt: skip

    def prepare_input(self, images: torch.Tensor, stats: Stats | None = None) -> torch.Tensor:
        """Raw images [B, C, H, W] -> each member's input by its own recipe, stacked [M, B, C, h, w]."""
        return torch.stack([recipe_of(m).prepare(images, stats) for m in self.members])

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None, **_) -> EnsembleOutput:
        inputs = images if images.dim() == 5 else self.prepare_input(images)
        lengths = torch.stack([m(x).lengths.float() for m, x in zip(self.members, inputs)]).mean(dim=0)  # [B, n]
        return EnsembleOutput(None, lengths, lengths.argmax(dim=1), None, None)

    def loss(self, out: EnsembleOutput, images: torch.Tensor, labels: torch.Tensor):
        """The margin loss (Eq. 4) of the averaged lengths."""
        margin = self.margin_loss(out.lengths, labels)
        return margin, {"margin": margin.detach(), "total": margin.detach()}
