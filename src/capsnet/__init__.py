"""capsnet: Capsule Networks with dynamic routing (Sabour, Frosst & Hinton 2017) for PyTorch."""

from ._version import __version__
from .errors import CapsNetError, CheckpointError, ConfigError, DatasetError
from .models.capsnet import CapsNet, CapsNetConfig, CapsNetOutput
from .models.pretrained import load_pretrained
from .nn.decoder import CapsuleDecoder
from .nn.losses import MarginLoss, capsule_lengths, reconstruction_loss
from .nn.primary import PrimaryCapsules
from .nn.squash import Squash, squash
from .routing.dynamic import Router, RoutingResult, dynamic_routing

__all__ = [
    "CapsNet",
    "CapsNetConfig",
    "CapsNetError",
    "CapsNetOutput",
    "CapsuleDecoder",
    "CheckpointError",
    "ConfigError",
    "DatasetError",
    "MarginLoss",
    "PrimaryCapsules",
    "Router",
    "RoutingResult",
    "Squash",
    "__version__",
    "capsule_lengths",
    "dynamic_routing",
    "load_pretrained",
    "reconstruction_loss",
    "squash",
]
