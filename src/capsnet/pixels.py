"""Raw images as floats: uint8 pixels p in 0..255 become x01 = p / 255, float images pass (the first step of every
input recipe, capsnet.models.recipe, and of the data readers' batches)."""

from __future__ import annotations

import torch


def to_float(images: torch.Tensor) -> torch.Tensor:
    """Images as float32 in [0, 1]: uint8 pixels are divided by 255 (on their device); float images pass through
    as float32."""
    return images.float().div_(255.0) if images.dtype == torch.uint8 else images.float()
