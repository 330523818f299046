"""The config of the heinsen-capsnet model (Heinsen's 2019 smallNORB classifier): its fields, the authors' defaults
and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import RecordedData, conv_output_size, register_config

# The stem's six 3×3 convolutions: strides 1, 2, 1, 2, 1, 2 (the authors' models.py)
STRIDES = (1, 2, 1, 2, 1, 2)


@dataclass
class HeinsenCapsNetConfig(RecordedData):
    """Hyper-parameters of `HeinsenCapsNet`; the defaults are the authors' smallNORB model (96×96 stereo
    pairs, 64 parts, 64 channels)."""

    in_channels: int = field(default=2, metadata={"help": "input image channels (smallNORB: the stereo pair)"})
    image_size: int = field(default=96, metadata={"help": "input image height and width"})
    n_classes: int = field(default=5, metadata={"help": "number of classes (object capsules), at least 2"})
    conv_channels: int = field(default=64, metadata={"help": "channels of the six 3x3 convolutions (their d_chns)"})
    n_parts: int = field(default=64, metadata={"help": "part capsule types, and the parts routed to (n_parts)"})
    routing_iterations: int = field(default=3, metadata={"help": "routing iterations r of both routings"})
    p_model: Literal["gaussian", "skm"] = field(
        default="gaussian", metadata={"help": "parent model of the routing: gaussian (the paper) or skm (soft k-means)"}
    )
    conv_padding: int | None = field(
        default=None,
        metadata={
            "help": "zero padding of the 3x3 convolutions: 0 (the authors', on 96x96) or 1; default: 0 where "
            "the image is 29 px or more, else 1 (28x28 digits are one pixel too small for the authors' stem)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("in_channels", "image_size", "conv_channels", "n_parts", "routing_iterations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_classes < 2 or self.n_parts < 2:
            raise ConfigError(f"n_classes and n_parts must be >= 2, got {self.n_classes}, {self.n_parts}")
        if self.p_model not in ("gaussian", "skm"):
            raise ConfigError(f"p_model must be 'gaussian' or 'skm', got {self.p_model!r}")
        if self.conv_padding not in (None, 0, 1):
            raise ConfigError(f"conv_padding must be 0 or 1, got {self.conv_padding}")
        self._check_recorded(self.n_classes)
        if self.grid_side(self.padding) < 1:
            raise ConfigError(
                f"images of {self.image_size}x{self.image_size} are too small for six 3x3 "
                f"convolutions with padding {self.padding}"
            )

    @property
    def padding(self) -> int:
        """The convolutions' padding: conv_padding, or when unset 0 (the authors') where the image allows it."""
        if self.conv_padding is not None:
            return self.conv_padding
        return 0 if self.grid_side(0) >= 1 else 1

    def grid_side(self, padding: int) -> int:
        """Side of the part capsule grid: 96 → 94 → 46 → 44 → 21 → 19 → 9 with the authors' padding 0."""
        s = self.image_size
        for stride in STRIDES:
            s = conv_output_size(s, 3, stride, padding)
        return s

    @property
    def n_children(self) -> int:
        """Part capsules routed by the first routing: n_parts × grid² (64 · 9² = 5,184 on smallNORB)."""
        return self.n_parts * self.grid_side(self.padding) ** 2


register_config("heinsen-capsnet", HeinsenCapsNetConfig)
