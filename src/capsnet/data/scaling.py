"""Per-channel pixel statistics of a split: the mean and population std that a model trained with per-channel
standardisation records, and that evaluation reads from the split being scored.

The recipe that applies them (x = (p − mean_c) / std_c) is the model's: capsnet.models.recipe. Per-channel
standardisation with each split's own statistics is the Efficient-CapsNet authors' smallNORB input
(EscVM/Efficient-CapsNet, utils/pre_process_smallnorb.py: every pixel of every image of the split, each channel
on its own, population std). Standardising commutes with crops and with resizing (whose weights sum to 1), so it
is applied to the batches, after the reader's resize and before the crops and photometric jitter.
"""

from __future__ import annotations

import torch

from ..errors import DatasetError
from .split import Split


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


__all__ = ["channel_stats"]
