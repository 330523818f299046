"""The config of the cluster-capsnet model: its fields, the authors' defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from .base import RecordedData, conv_output_size, register_config


@dataclass
class ClusterCapsNetConfig(RecordedData):
    """Hyper-parameters of :class:`ClusterCapsNet`; defaults: the authors' CIFAR-10 model (C 4, K 8, D 24)."""

    in_channels: int = field(default=3, metadata={"help": "input image channels"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (capsule channels of the last layer)"})
    capsule_channels: int = field(default=4, metadata={"help": "capsule channels C of the hidden capsule layers"})
    votes: int = field(default=8, metadata={"help": "votes K in each cluster"})
    capsule_dim: int = field(default=24, metadata={"help": "capsule dimension D"})
    strides: tuple[int, ...] = field(
        default=(1, 2, 1, 2, 1),
        metadata={"help": "stride of each capsule layer's 3x3 vote convolutions (the last one routes to the classes)"},
    )
    bias: bool = field(default=True, metadata={"help": "biased vote convolutions (the authors' default)"})

    def __post_init__(self) -> None:
        self.strides = tuple(self.strides)
        for name in ("in_channels", "image_size", "capsule_channels", "capsule_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_classes < 2:
            raise ConfigError(f"n_classes must be >= 2, got {self.n_classes}")
        if self.votes < 2:
            raise ConfigError(f"votes must be >= 2 (one vote has no spread), got {self.votes}")
        if len(self.strides) < 2 or min(self.strides) < 1:
            raise ConfigError(
                f"strides need one positive value per capsule layer, at least 2, got {list(self.strides)}"
            )
        self._check_recorded(self.n_classes)

    @property
    def grids(self) -> list[int]:
        """Side of each capsule layer's grid: 32 → 32, 16, 16, 8, 8 (3×3 convolutions, padding 1)."""
        sides = [self.image_size]
        for stride in self.strides:
            sides.append(conv_output_size(sides[-1], 3, stride, 1))
        return sides[1:]


register_config("cluster-capsnet", ClusterCapsNetConfig)
