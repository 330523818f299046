"""The config of the hvc-capsnet model: its fields, paper defaults and checks.

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
class HVCCapsNetConfig(RecordedData):
    """Hyper-parameters of `HVCCapsNet`; the defaults are the paper's MNIST network."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int | tuple[int, ...] = field(
        default=28, metadata={"help": "input image side, or [height, width] for non-square images"}
    )
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules), at least 2"})
    channels: tuple[int, ...] = field(
        default=(32, 48, 64, 80, 96, 112, 128, 144, 160),
        metadata={"help": "output channels of the 3x3 convolutions (paper: 32 growing by 16 per layer)"},
    )
    branches_after: tuple[int, ...] = field(
        default=(3, 6, 9), metadata={"help": "the convolutions (1-based) a capsule branch leaves from"}
    )
    capsule_layout: Literal["position", "filter"] = field(
        default="position",
        metadata={
            "help": "primary capsules of a branch: position (the C channels at each position, the authors' "
            "2021 code) or filter (each feature map one H*W capsule, the arXiv v1-v5 network)"
        },
    )
    branch_merge: Literal["learned", "equal"] = field(
        default="learned",
        metadata={"help": "branch weights: learned from 1 (the paper's best) or fixed equal weights"},
    )
    bn_momentum: float = field(
        default=0.1,
        metadata={
            "help": "BatchNorm running-statistics momentum; the authors' 0.0003 (decay 0.9997) goes with their "
            "evaluation of averaged weights, which capsnet does not keep (docs/fidelity.md)"
        },
    )

    def __post_init__(self) -> None:
        self.channels, self.branches_after = tuple(self.channels), tuple(self.branches_after)
        if self.in_channels < 1:
            raise ConfigError(f"in_channels must be >= 1, got {self.in_channels}")
        if self.n_classes < 2:
            raise ConfigError(f"n_classes must be >= 2, got {self.n_classes}")
        if not isinstance(self.image_size, int):
            self.image_size = tuple(self.image_size)
            if len(self.image_size) != 2:
                raise ConfigError(f"image_size must be a side or [height, width], got {list(self.image_size)}")
        self._check_recorded(self.n_classes)
        if not self.channels or min(self.channels) < 1:
            raise ConfigError("channels must be a non-empty list of positive channel counts")
        after = self.branches_after
        if not after or list(after) != sorted(set(after)) or after[0] < 1 or after[-1] > len(self.channels):
            raise ConfigError(
                f"branches_after must be increasing convolution numbers in 1..{len(self.channels)}, got {list(after)}"
            )
        if not 0 < self.bn_momentum <= 1:
            raise ConfigError(f"bn_momentum must be in (0, 1], got {self.bn_momentum}")
        if min(self.feature_hw(len(self.channels))) < 1:
            h, w = image_hw(self.image_size)
            raise ConfigError(f"images of {h}x{w} are too small for {len(self.channels)} unpadded 3x3 convolutions")

    def feature_hw(self, k: int) -> tuple[int, int]:
        """(H, W) after convolution k (1-based): each unpadded 3×3 convolution takes 2 off each side's length."""
        h, w = image_hw(self.image_size)
        return h - 2 * k, w - 2 * k

    def branch_capsules(self, k: int) -> tuple[int, int]:
        """(N capsules, D dimensions) of the branch after convolution k: position capsules (H·W, C), filter
        capsules (C, H·W); (484, 64), (256, 112), (100, 160) for the paper's position capsules on MNIST."""
        h, w = self.feature_hw(k)
        c = self.channels[k - 1]
        return (h * w, c) if self.capsule_layout == "position" else (c, h * w)


register_config("hvc-capsnet", HVCCapsNetConfig)
