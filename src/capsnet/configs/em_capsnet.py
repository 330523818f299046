"""The config of the em-capsnet model: its fields, paper defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import (
    FINAL_LAMBDA,
    TRAINED_MIN_VAR,
    RecordedData,
    register_config,
)


@dataclass
class EMCapsNetConfig(RecordedData):
    """Hyper-parameters of `EMCapsNet`; the defaults are the paper's smallNORB model (A=B=C=D=32)."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=5, metadata={"help": "number of classes (class capsules)"})
    conv_channels: int = field(default=32, metadata={"help": "A: channels of the first convolution"})
    conv_kernel: int = field(default=5, metadata={"help": "kernel of the first convolution (stride 2)"})
    primary_types: int = field(default=32, metadata={"help": "B: primary capsule types"})
    caps1_types: int = field(default=32, metadata={"help": "C: ConvCaps1 capsule types (K=3, stride 2)"})
    caps2_types: int = field(default=32, metadata={"help": "D: ConvCaps2 capsule types (K=3, stride 1)"})
    routing_iterations: int = field(default=3, metadata={"help": "routing iterations r"})
    final_lambda: float = field(
        default=FINAL_LAMBDA, metadata={"help": "EM inverse temperature: lambda_t = final_lambda (1 - 0.95^(t+1))"}
    )
    min_var: float = field(
        default=TRAINED_MIN_VAR,
        metadata={"help": "floor of the EM variances sigma^2 (bounds 1/sigma^2 in the gradients)"},
    )
    centre_activations: bool = field(
        default=True, metadata={"help": "start beta_a so that half the capsules are active on the first batch"}
    )
    coordinate_addition: bool = field(default=True, metadata={"help": "add scaled positions to the class votes"})
    # "grid": Gritzman's fc_caps, (col + 1/2)/W into V[0, 3] and (row + 1/2)/H into V[1, 3] on the class layer's
    # input grid; "receptive-field": (row, col) of each position's receptive-field centre in pixels / image size,
    # into V[0, 3], V[1, 3] (the layout of folders whose config.json lacks the key, EMCapsNet.saved_defaults).
    coordinate_style: Literal["grid", "receptive-field"] = field(
        default="grid", metadata={"help": "coordinate addition: grid (the authors') or receptive-field"}
    )
    class_loss: Literal["spread", "margin", "cross_entropy"] = field(
        default="spread", metadata={"help": "loss on the class activations"}
    )
    margin_anneal_steps: int = field(
        default=10000, metadata={"help": "training steps over which the spread loss margin grows from 0.2 to 0.9"}
    )

    def __post_init__(self) -> None:
        ints = (
            "in_channels",
            "image_size",
            "n_classes",
            "conv_channels",
            "conv_kernel",
            "primary_types",
            "caps1_types",
            "caps2_types",
            "routing_iterations",
            "margin_anneal_steps",
        )
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_recorded(self.n_classes)
        if self.final_lambda <= 0 or self.min_var <= 0:
            raise ConfigError(f"final_lambda and min_var must be > 0, got {self.final_lambda}, {self.min_var}")
        if self.coordinate_style not in ("grid", "receptive-field"):
            raise ConfigError(f"coordinate_style must be 'grid' or 'receptive-field', got {self.coordinate_style!r}")
        if self.class_grid < 1:
            raise ConfigError(f"image_size {self.image_size} is too small for EMCapsNet's layers")

    def layer_geometry(self) -> list[tuple[int, int]]:
        """(kernel, stride) of the layers that shrink the grid: conv, ConvCaps1, ConvCaps2."""
        return [(self.conv_kernel, 2), (3, 2), (3, 1)]

    @property
    def class_grid(self) -> int:
        """Side of the ConvCaps2 grid the class capsules read: 32 → 14 → 6 → 4."""
        s = self.image_size
        for k, stride in self.layer_geometry():
            s = (s - k) // stride + 1
        return s


register_config("em-capsnet", EMCapsNetConfig)
