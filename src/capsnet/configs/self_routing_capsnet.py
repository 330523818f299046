"""The config of the self-routing-capsnet model: its fields, paper defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

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
class SelfRoutingCapsNetConfig(RecordedData):
    """Hyper-parameters of `SelfRoutingCapsNet`; defaults: the authors' CIFAR-10 model (ResNet-20 backbone)."""

    in_channels: int = field(default=3, metadata={"help": "input image channels"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules)"})
    resnet_widths: tuple[int, ...] = field(default=(16, 32, 64), metadata={"help": "channels of the ResNet stages"})
    resnet_blocks: int = field(default=3, metadata={"help": "basic blocks per ResNet stage (3: ResNet-20)"})
    shortcut: Literal["identity", "projection"] = field(
        default="identity",
        metadata={
            "help": "ResNet shortcut where the shape changes: zero-padded identity (He et al.'s option A, "
            "the authors' code) or 1x1 convolution + BatchNorm (option B)"
        },
    )
    primary_types: int = field(default=32, metadata={"help": "primary capsule types"})
    pose_dim: int = field(default=16, metadata={"help": "capsule pose size (a square: 16 = 4x4 matrices)"})
    primary_batchnorm: bool = field(
        default=True,
        metadata={
            "help": "BatchNorm on the primary poses, convolutions without bias (the authors' code); "
            "--no-primary-batchnorm: a biased pose convolution without it"
        },
    )
    capsule_types: tuple[int, ...] = field(
        default=(), metadata={"help": "types of each conv capsule layer before the class capsules (authors: none)"}
    )
    capsule_strides: tuple[int, ...] = field(default=(), metadata={"help": "their strides (3x3 kernels)"})

    def __post_init__(self) -> None:
        self.resnet_widths = tuple(self.resnet_widths)
        self.capsule_types, self.capsule_strides = tuple(self.capsule_types), tuple(self.capsule_strides)
        for name in ("in_channels", "image_size", "n_classes", "resnet_blocks", "primary_types", "pose_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.resnet_widths or min(self.resnet_widths) < 1:
            raise ConfigError("resnet_widths must be a non-empty list of positive channel counts")
        if self.shortcut not in ("identity", "projection"):
            raise ConfigError(f"shortcut must be 'identity' or 'projection', got {self.shortcut!r}")
        if self.shortcut == "identity" and any(b < a for a, b in zip(self.resnet_widths, self.resnet_widths[1:])):
            raise ConfigError(
                "identity shortcuts zero-pad channels: resnet_widths must not decrease (or use shortcut 'projection')"
            )
        check_capsule_layers(self)
        self._check_recorded(self.n_classes)

    @property
    def grids(self) -> list[int]:
        """Side of the primary capsule grid, then of each conv capsule layer's: 32 → 8 (backbone) by default."""
        s = self.image_size
        for _ in self.resnet_widths[1:]:
            s = conv_output_size(s, 3, 2, padding=1)  # a stride-2 stage
        sizes = [s]
        for stride in self.capsule_strides:
            sizes.append(conv_output_size(sizes[-1], 3, stride))
        return sizes


register_config("self-routing-capsnet", SelfRoutingCapsNetConfig)
