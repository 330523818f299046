"""From uint8 pixels to a model's input values: p / divisor, or per-channel standardisation (p − mean_c) / std_c.

Models record which one they were trained with in their config (capsnet.models.inputs.RecordedData:
`input_divisor`, `channel_standardize`, `channel_mean`, `channel_std`), so that evaluation and prediction feed a
model what it was trained on. The batches arrive as `to_float`'s p / 255 in [0, 1]; :class:`InputScaling` maps
them on, per channel: x = (255 · x01 − mean_c) / std_c (the identity for mean 0, std 255).

Per-channel standardisation with each split's own statistics is the Efficient-CapsNet authors' smallNORB input
(EscVM/Efficient-CapsNet, utils/pre_process_smallnorb.py: every pixel of every image of the split, each channel
on its own, population std). Standardising commutes with crops and with resizing (whose weights sum to 1), so it
is applied to the batches, after the reader's resize and before the crops and photometric jitter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DatasetError
from .split import Split


@dataclass(frozen=True)
class InputScaling:
    """x = (p − mean_c) / std_c of pixels p, applied to float batches x01 = p / 255 [B, C, H, W]. One value
    stands for every channel."""

    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (255.0,)

    @property
    def identity(self) -> bool:
        return all(m == 0 for m in self.mean) and all(s == 255 for s in self.std)

    def __call__(self, x01: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return x01
        c = x01.shape[1]
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, c):
                raise DatasetError(f"input scaling: {len(values)} {name} values for images with {c} channels")
        mean = torch.tensor(self.mean, dtype=x01.dtype, device=x01.device).view(1, -1, 1, 1) / 255.0
        scale = 255.0 / torch.tensor(self.std, dtype=x01.dtype, device=x01.device).view(1, -1, 1, 1)
        return (x01 - mean) * scale  # (p/255 − mean/255) · 255/std = (p − mean) / std


def channel_stats(split: Split, *, chunk: int = 1024) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std of a split's pixels (float64; those its reader measured on the
    originals when it resized them, `Split.channel_stats`, if any)."""
    if split.channel_stats is not None:
        return split.channel_stats
    images = split.images
    if len(images) == 0:
        raise DatasetError("channel statistics of an empty split")
    c = images.shape[1]
    total = torch.zeros(c, dtype=torch.float64)
    squares = torch.zeros(c, dtype=torch.float64)
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk].to("cpu", torch.float64).transpose(0, 1).reshape(c, -1)
        total += x.sum(dim=1)
        squares += (x * x).sum(dim=1)
    n = images[0, 0].numel() * len(images)
    mean = total / n
    std = (squares / n - mean * mean).clamp_min(0).sqrt()
    if (std == 0).any():
        raise DatasetError("a channel of the split is constant: it cannot be standardized")
    return tuple(mean.tolist()), tuple(std.tolist())


def scaling_for(
    *, divisor: float = 255.0, channel_standardize: bool = False, split: Split | None = None,
    mean: Sequence[float] = (), std: Sequence[float] = (),
) -> InputScaling:  # fmt: skip
    """The scaling of a pipeline: p / divisor; with `channel_standardize`, `split`'s own statistics, else the given
    (recorded) `mean` and `std`."""
    if not channel_standardize:
        return InputScaling((0.0,), (float(divisor),))
    if split is not None:
        return InputScaling(*channel_stats(split))
    if not std:
        raise DatasetError("the model standardizes each channel with its training split's statistics, which its "
                           "config.json does not record; evaluate it on a data set split instead")  # fmt: skip
    return InputScaling(tuple(mean), tuple(std))


def model_scaling(cfg: Any, split: Split | None = None) -> InputScaling:
    """The scaling a model's config records (defaults: ÷ 255): with channel standardisation, the statistics of
    `split` (the data being evaluated), or for single images (`split` None) the training split's."""
    return scaling_for(
        divisor=getattr(cfg, "input_divisor", 255.0), channel_standardize=getattr(cfg, "channel_standardize", False),
        split=split, mean=getattr(cfg, "channel_mean", ()), std=getattr(cfg, "channel_std", ()),
    )  # fmt: skip


__all__ = ["InputScaling", "channel_stats", "model_scaling", "scaling_for"]
