"""The config of the vb-capsnet model: its fields, the authors' defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import RecordedData, register_config


@dataclass
class VBCapsNetConfig(RecordedData):
    """Hyper-parameters of `VBCapsNet`; the defaults are the authors' smallNORB model (`--arch 64 8 16 16 5`,
    stereo pairs cropped to 32×32)."""

    in_channels: int = field(default=2, metadata={"help": "input image channels (smallNORB: the stereo pair)"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=5, metadata={"help": "number of classes (class capsules)"})
    conv_channels: int = field(default=64, metadata={"help": "A: channels of the first 5x5 convolution (stride 2)"})
    primary_types: int = field(default=8, metadata={"help": "B: primary capsule types (1x1)"})
    caps1_types: int = field(default=16, metadata={"help": "C: first conv capsule types (K=3, stride 2)"})
    caps2_types: int = field(default=16, metadata={"help": "D: second conv capsule types (K=3, stride 1)"})
    routing_iterations: int = field(default=3, metadata={"help": "VB routing iterations"})
    alpha0: float = field(default=1.0, metadata={"help": "Dirichlet prior alpha0 over the mixing proportions"})
    kappa0: float = field(default=1.0, metadata={"help": "precision scale kappa0 of the Gaussian prior on the means"})
    nu0: float = field(default=17.0, metadata={"help": "Wishart degrees of freedom nu0 (> 15; the authors': 16 + 1)"})
    psi0: float = field(default=1.0, metadata={"help": "Psi0^-1 = psi0 I, the Wishart prior's inverse scale"})
    # "authors": what their released code adds (the class layer's output grid is 1×1, so every position gets
    # (0 + 1)/10 = 0.1 in V[0, 3] and V[1, 3]); "positions": what it is written to add, (row + 1)/(10 g) and
    # (col + 1)/(10 g) on the g×g grid; "none".
    coordinates: Literal["authors", "positions", "none"] = field(
        default="authors",
        metadata={
            "help": "coordinate addition in the class votes: authors (their code: 0.1 everywhere), "
            "positions ((row+1)/10g, (col+1)/10g) or none"
        },
    )
    min_normaliser: float = field(
        default=1e-11,
        metadata={
            "help": "floor of each child's sum of responsibilities (the authors' 1e-11; 0: the paper's exact "
            "normalisation)"
        },
    )

    def __post_init__(self) -> None:
        ints = (
            "in_channels",
            "image_size",
            "n_classes",
            "conv_channels",
            "primary_types",
            "caps1_types",
            "caps2_types",
            "routing_iterations",
        )
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_recorded(self.n_classes)
        if not (self.alpha0 > 0 and self.kappa0 > 0 and self.psi0 > 0):
            raise ConfigError(f"alpha0, kappa0 and psi0 must be > 0, got {self.alpha0}, {self.kappa0}, {self.psi0}")
        if not self.nu0 > 15:
            raise ConfigError(f"nu0 must be > 15 (the pose has 16 entries), got {self.nu0}")
        if not self.min_normaliser >= 0:
            raise ConfigError(f"min_normaliser must be >= 0, got {self.min_normaliser}")
        if self.coordinates not in ("authors", "positions", "none"):
            raise ConfigError(f"coordinates must be authors, positions or none, got {self.coordinates!r}")
        if self.class_grid < 1:
            raise ConfigError(f"image_size {self.image_size} is too small for VBCapsNet's layers")

    @property
    def class_grid(self) -> int:
        """Side of the grid the class capsules read: 32 → 14 (conv 5, stride 2) → 6 (K=3, stride 2) → 4 (K=3)."""
        s = self.image_size
        for k, stride in ((5, 2), (3, 2), (3, 1)):
            s = (s - k) // stride + 1
        return s


register_config("vb-capsnet", VBCapsNetConfig)
