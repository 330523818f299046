"""The input check every model's forward starts with, and the config fields recorded from the training data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError


@dataclass(kw_only=True)
class RecordedData:
    """Config fields that describe the data a model was trained on rather than its architecture: the training
    task (capsnet.training.tasks) fills them in from the data set, and predict, evaluate and visualize read them.
    A model config inherits them (keyword-only, so its own fields keep their positions) and calls
    `_check_recorded(n_classes)` in its `__post_init__`."""

    standardize: bool = field(
        default=False, metadata={"help": "per-image standardization of the input; set from the data set's augmentation"}
    )
    class_names: tuple[str, ...] = field(default=(), metadata={"help": "the training data's class names"})
    digits: bool = field(
        default=True, metadata={"help": "trained on a digit set: predict inverts and boxes images as MNIST's"}
    )
    source_size: tuple[int, ...] = field(
        default=(), metadata={"help": "[H, W] of the training images before cropping (empty: image_size)"}
    )

    def _check_recorded(self, n_classes: int) -> None:
        """Lists from config.json become tuples; one class name per class."""
        self.class_names, self.source_size = tuple(self.class_names), tuple(self.source_size)
        if self.class_names and len(self.class_names) != n_classes:
            raise ConfigError(f"{len(self.class_names)} class_names for n_classes {n_classes}")


# The config fields that come from the training data rather than from the user: the input's shape and classes,
# and RecordedData's. Training fills them in from the data set; a pretrained model keeps the ones it was saved with.
DATA_FIELDS = ("in_channels", "image_size", "n_classes", "standardize", "class_names", "digits", "source_size")


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


def check_capsule_layers(config: Any) -> None:
    """ConfigError unless a config's stack of matrix-pose capsule layers is buildable: one positive
    `capsule_types` and `capsule_strides` entry per layer, a square `pose_dim`, and a last `grids` side >= 1."""
    types, strides = config.capsule_types, config.capsule_strides
    if len(types) != len(strides) or min((*types, *strides, 1)) < 1:
        raise ConfigError("capsule_types and capsule_strides need one positive value per capsule layer")
    if int(config.pose_dim**0.5) ** 2 != config.pose_dim:
        raise ConfigError(f"pose_dim must be a square (poses are matrices), got {config.pose_dim}")
    if config.grids[-1] < 1:
        raise ConfigError(f"image_size {config.image_size} is too small for the capsule layers")
