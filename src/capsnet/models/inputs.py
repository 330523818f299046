"""The input check every model's forward starts with, and the config fields recorded from the training data."""

from __future__ import annotations

from dataclasses import dataclass, field

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
