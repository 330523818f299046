"""The config of the inverted-attention-capsnet model: its fields, paper defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import (
    RecordedData,
    check_capsule_layers,
    conv_output_size,
    register_config,
)


@dataclass
class InvertedAttentionCapsNetConfig(RecordedData):
    """Hyper-parameters of `InvertedAttentionCapsNet`; defaults: Tsai et al.'s CIFAR-10 simple-backbone model."""

    in_channels: int = field(default=3, metadata={"help": "input image channels"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules)"})
    stem_channels: int = field(default=128, metadata={"help": "channels of the backbone's 3x3 stride-2 convolution"})
    primary_types: int = field(default=32, metadata={"help": "primary capsule types"})
    pose_dim: int = field(default=16, metadata={"help": "capsule pose size (a square: 16 = 4x4 matrices)"})
    capsule_types: tuple[int, ...] = field(default=(32, 32), metadata={"help": "types of each conv capsule layer"})
    capsule_strides: tuple[int, ...] = field(default=(2, 1), metadata={"help": "their strides (3x3 kernels)"})
    routing_iterations: int = field(default=2, metadata={"help": "routing iterations r"})
    concurrent: bool = field(
        default=True, metadata={"help": "route all capsule layers concurrently (paper) or one by one"}
    )
    # Eq. 2 of the paper has no factor; the authors' released code multiplies the agreement by 1/√d (0.25 here).
    agreement_scale: float | None = field(
        default=None,
        metadata={
            "help": "factor on the agreement p_j.v_ij (unset: 1/sqrt(pose_dim), the authors' code, 0.25 for "
            "4x4 poses; 1: Eq. 2 as the paper prints it)"
        },
    )
    backbone: Literal["simple", "resnet"] = field(
        default="simple",
        metadata={"help": "simple (one 3x3 stride-2 convolution) or resnet (the authors' ResNet backbone)"},
    )
    input_mean: tuple[float, ...] = field(
        default=(), metadata={"help": "per-channel mean subtracted from the [0, 1] input (empty: none)"}
    )
    input_std: tuple[float, ...] = field(
        default=(),
        metadata={
            "help": "per-channel std the input is divided by (the authors' CIFAR-10: "
            "0.2023 0.1994 0.2010 with mean 0.4914 0.4822 0.4465)"
        },
    )
    conv_windows: Literal["true", "released"] = field(
        default="true",
        metadata={
            "help": "windows of the conv capsule layers: true (the paper) or released (the authors' code's "
            "expansion, which mixes locations; for their converted checkpoints)"
        },
    )

    def __post_init__(self) -> None:
        self.capsule_types, self.capsule_strides = tuple(self.capsule_types), tuple(self.capsule_strides)
        names = (
            "in_channels",
            "image_size",
            "n_classes",
            "stem_channels",
            "primary_types",
            "pose_dim",
            "routing_iterations",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.agreement_scale is not None and not self.agreement_scale > 0:
            raise ConfigError(f"agreement_scale must be > 0, got {self.agreement_scale}")
        self.input_mean, self.input_std = tuple(self.input_mean), tuple(self.input_std)
        if len(self.input_mean) != len(self.input_std) or len(self.input_mean) not in (0, self.in_channels):
            raise ConfigError(
                f"input_mean and input_std need one value per input channel ({self.in_channels}), "
                f"got {len(self.input_mean)} and {len(self.input_std)}"
            )
        if self.input_std and min(self.input_std) <= 0:
            raise ConfigError(f"input_std must be > 0, got {list(self.input_std)}")
        check_capsule_layers(self)
        self._check_recorded(self.n_classes)

    @property
    def scale(self) -> float:
        """The agreement's factor: `agreement_scale`, or 1/√pose_dim when unset (the authors' code)."""
        return self.agreement_scale if self.agreement_scale is not None else 1.0 / math.sqrt(self.pose_dim)

    @property
    def grids(self) -> list[int]:
        """Side of each capsule grid: primary, then after each conv capsule layer (32 → 16, 7, 5)."""
        sizes = [conv_output_size(self.image_size + 2, 3, 2)]  # the backbone: 3×3, stride 2, padding 1
        for s in self.capsule_strides:
            sizes.append(conv_output_size(sizes[-1], 3, s))
        return sizes


register_config("inverted-attention-capsnet", InvertedAttentionCapsNetConfig)
