"""The input check every model's forward starts with."""

from __future__ import annotations

import torch


def image_hw(size: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    """A config's `image_size` as (height, width): an int is a square side, a pair is [height, width]."""
    if isinstance(size, int):
        return size, size
    height, width = size
    return int(height), int(width)


def check_images(images: torch.Tensor, *, channels: int, size: int | tuple[int, ...], model: str) -> None:
    """ValueError unless `images` is a batch [B, channels, H, W] of the size (`size`: a side, or (H, W)) `model`
    was built for."""
    h, w = image_hw(size)
    if images.dim() != 4 or tuple(images.shape[1:]) != (channels, h, w):
        raise ValueError(f"{model} expects images of shape [B, {channels}, {h}, {w}], got {list(images.shape)}")
