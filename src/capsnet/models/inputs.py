"""The input check every model's forward starts with, and the config fields recorded from the training data."""

from __future__ import annotations

import torch

# (the recorded-data fields and shape checks live torch-free in capsnet.configs.base; imported here by name)
from ..configs.base import DATA_FIELDS as DATA_FIELDS
from ..configs.base import RECORDED_SAVED_DEFAULTS as RECORDED_SAVED_DEFAULTS
from ..configs.base import RecordedData as RecordedData
from ..configs.base import check_capsule_layers as check_capsule_layers
from ..configs.base import check_loss_options as check_loss_options
from ..configs.base import image_hw as image_hw


def check_images(images: torch.Tensor, *, channels: int, size: int | tuple[int, ...], model: str) -> None:
    """ValueError unless `images` is a batch [B, channels, H, W] of the size (`size`: a side, or (H, W)) `model`
    was built for; TypeError for raw integer pixels (forward takes the prepared input: docs/inputs.md). The dtype is
    metadata: the check costs no host sync."""
    if not images.is_floating_point():
        raise TypeError(
            f"{model} takes its prepared input (floats), got {str(images.dtype).replace('torch.', '')} "
            "images: capsnet.preprocess(model, images) makes it from raw pixels, and "
            "capsnet.predict(model, images) classifies them"
        )
    h, w = image_hw(size)
    if images.dim() != 4 or tuple(images.shape[1:]) != (channels, h, w):
        raise ValueError(f"{model} expects images of shape [B, {channels}, {h}, {w}], got {list(images.shape)}")
