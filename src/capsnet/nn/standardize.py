"""Per-image standardization, as TensorFlow's `tf.image.per_image_standardization` (the official CapsNet code's
CIFAR-10 input pipeline): each image to zero mean and unit variance over all its pixels and channels."""

from __future__ import annotations

import math

import torch


def per_image_standardize(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, H, W] -> (x - mean) / max(std, 1/sqrt(C·H·W)), statistics per image (the floor keeps a uniform
    image finite: it becomes zeros)."""
    n = x[0].numel() if x.shape[0] else 1
    flat = x.flatten(1)
    mean = flat.mean(dim=1)
    std = flat.std(dim=1, unbiased=False).clamp_min(1.0 / math.sqrt(n))
    return (x - mean.view(-1, 1, 1, 1)) / std.view(-1, 1, 1, 1)
