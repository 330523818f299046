"""Several trained models as one: the average of their class probabilities (capsule lengths).

The paper's CIFAR-10 result (§7, 10.6% error) is "an ensemble of 7 models", each trained with the same setup;
`capsnet evaluate --checkpoint RUN1 --checkpoint RUN2 ...` evaluates such an ensemble with :class:`Ensemble`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import CheckpointError
from ..models.inputs import image_hw
from ..nn.losses import MarginLoss


class EnsembleOutput(NamedTuple):
    """Mirrors :class:`capsnet.CapsNetOutput`: the averaged lengths and their argmax."""

    capsules: None
    lengths: torch.Tensor  # mean over the members of |v_j| (or a baseline's softmax)  [B, n_classes]
    predictions: torch.Tensor  # argmax  [B]
    reconstructions: None
    coupling: None


class Ensemble(nn.Module):
    """Averages the class probabilities of `models`, which must take the same input (channels, size, the size
    before cropping) and have the same classes. `config` is the first member's (what evaluate() reads)."""

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        if not models:
            raise CheckpointError("an ensemble needs at least one model")
        first: Any = models[0].config
        for k, m in enumerate(models[1:], start=2):
            cfg: Any = m.config
            for what in ("in_channels", "n_classes", "class_names", "source_size"):
                a, b = getattr(first, what, None), getattr(cfg, what, None)
                if a != b:
                    raise CheckpointError(f"checkpoint {k} has {what} {b}, the first has {a}: not one ensemble")
            if image_hw(cfg.image_size) != image_hw(first.image_size):
                raise CheckpointError(f"checkpoint {k} takes {cfg.image_size} images, the first {first.image_size}")
        self.members = nn.ModuleList(models)
        self.config = first
        self.margin_loss = MarginLoss(first.n_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None, **_) -> EnsembleOutput:
        lengths = torch.stack([m(images).lengths.float() for m in self.members]).mean(dim=0)  # [B, n_classes]
        return EnsembleOutput(None, lengths, lengths.argmax(dim=1), None, None)

    def loss(self, out: EnsembleOutput, images: torch.Tensor, labels: torch.Tensor):
        """The margin loss (Eq. 4) of the averaged lengths."""
        margin = self.margin_loss(out.lengths, labels)
        return margin, {"margin": margin.detach(), "total": margin.detach()}
