"""The config of the deepcaps model: its fields, the authors' defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import RecordedData, register_config


@dataclass
class DeepCapsConfig(RecordedData):
    """Hyper-parameters of `DeepCaps`; the defaults are the authors' 28×28 network."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int = field(default=28, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules)"})
    conv_channels: int = field(default=128, metadata={"help": "channels of the first convolution (1-D capsules)"})
    cell_types: tuple[int, ...] = field(default=(32, 32, 32, 32), metadata={"help": "capsule types of each cell"})
    cell_dims: tuple[int, ...] = field(default=(4, 8, 8, 8), metadata={"help": "capsule dimensions of each cell"})
    class_dim: int = field(default=32, metadata={"help": "dimensions of the class capsules"})
    routing_iterations: int = field(default=3, metadata={"help": "iterations of the 3D and the class routing"})
    conv3d_input: Literal["capsules", "released"] = field(
        default="capsules",
        metadata={"help": "how ConvCaps3D reads its input: capsules (the paper) or released (the authors' reshape)"},
    )
    decoder: bool = field(default=True, metadata={"help": "build the class-independent decoder"})
    decoder_channels: tuple[int, ...] = field(
        default=(64, 32, 16), metadata={"help": "transposed convolutions before the output one (strides 1, 2, 2, ...)"}
    )
    recon_weight: float = field(default=0.4, metadata={"help": "weight of the mean squared reconstruction error"})

    def __post_init__(self) -> None:
        self.cell_types, self.cell_dims = tuple(self.cell_types), tuple(self.cell_dims)
        self.decoder_channels = tuple(self.decoder_channels)
        for name in ("in_channels", "image_size", "conv_channels", "class_dim", "routing_iterations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_classes < 2:
            raise ConfigError(f"n_classes must be >= 2, got {self.n_classes}")
        self._check_recorded(self.n_classes)
        if (
            len(self.cell_types) < 2
            or len(self.cell_types) != len(self.cell_dims)
            or min(self.cell_types + self.cell_dims) < 1
        ):
            raise ConfigError("cell_types and cell_dims need one positive entry per cell, at least 2 cells")
        if self.conv3d_input not in ("capsules", "released"):
            raise ConfigError(f"conv3d_input must be 'capsules' or 'released', got {self.conv3d_input!r}")
        if self.recon_weight < 0:
            raise ConfigError(f"recon_weight must be >= 0, got {self.recon_weight}")
        ups = 2 ** (len(self.decoder_channels) - 1)
        if self.decoder and (not self.decoder_channels or min(self.decoder_channels) < 1 or self.image_size % ups):
            raise ConfigError(
                f"the decoder's {len(self.decoder_channels)} transposed convolutions upsample by "
                f"{ups}: image_size {self.image_size} must be a multiple of it"
            )

    def grids(self) -> list[int]:
        """The side of each cell's grid ("same" padding, stride 2: ⌈n/2⌉ per cell)."""
        sides, s = [], self.image_size
        for _ in self.cell_types:
            s = math.ceil(s / 2)
            sides.append(s)
        return sides

    @property
    def n_class_inputs(self) -> int:
        """Capsules the class layer routes: the last two cells' grids, flattened."""
        g = self.grids()
        return g[-1] ** 2 * self.cell_types[-1] + g[-2] ** 2 * self.cell_types[-2]


register_config("deepcaps", DeepCapsConfig)
