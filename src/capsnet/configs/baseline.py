"""The config of the baseline model: its fields, paper defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import (
    RecordedData,
    image_hw,
    register_config,
)


@dataclass
class BaselineConfig(RecordedData):
    """Hyper-parameters of `BaselineCNN`; the defaults are the paper's MNIST baseline (35.4M parameters)."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int | tuple[int, ...] = field(
        default=28, metadata={"help": "input image side, or [height, width] for non-square images"}
    )
    n_classes: int = field(default=10, metadata={"help": "number of classes, at least 2"})
    channels: tuple[int, ...] = field(default=(256, 256, 128), metadata={"help": "channels of the convolutions"})
    kernel_size: int = field(default=5, metadata={"help": "kernel of every convolution (stride 1)"})
    padding: Literal["same", "valid"] = field(default="same", metadata={"help": "convolution padding"})
    pool: bool = field(default=False, metadata={"help": "2x2 max-pooling after each convolution (not the paper's)"})
    hidden: tuple[int, ...] = field(default=(328, 192), metadata={"help": "fully connected layer sizes"})
    dropout: float = field(default=0.5, metadata={"help": "dropout before the softmax layer"})

    def __post_init__(self) -> None:
        self.channels, self.hidden = tuple(self.channels), tuple(self.hidden)
        if not isinstance(self.image_size, int):
            self.image_size = tuple(self.image_size)
        for name in ("in_channels", "kernel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_classes < 2:
            raise ConfigError(f"n_classes must be >= 2, got {self.n_classes}")
        self._check_recorded(self.n_classes)
        bad_pair = not isinstance(self.image_size, int) and len(self.image_size) != 2
        if bad_pair or min(image_hw(self.image_size)) < 1:
            raise ConfigError(f"image_size must be a positive side or [height, width], got {self.image_size}")
        if not self.channels or min(self.channels) < 1 or (self.hidden and min(self.hidden) < 1):
            raise ConfigError("channels must be a non-empty list of positive sizes; hidden sizes must be positive")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if min(self.feature_hw) < 1:
            raise ConfigError(f"image_size {self.image_size} is too small for {len(self.channels)} convolutions")

    @property
    def feature_hw(self) -> tuple[int, int]:
        """(H, W) of the last feature map: 28 stays 28 with "same" padding; 28 → 24 → 20 → 16 with "valid"."""
        sides = []
        for s in image_hw(self.image_size):
            for _ in self.channels:
                s = s if self.padding == "same" else s - self.kernel_size + 1
                s = s // 2 if self.pool else s
            sides.append(s)
        return sides[0], sides[1]

    @property
    def feature_size(self) -> int:
        """Side of a square last feature map (the height of a non-square one: see feature_hw)."""
        return self.feature_hw[0]


register_config("baseline", BaselineConfig)
