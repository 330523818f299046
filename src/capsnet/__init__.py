"""capsnet: Capsule Networks with dynamic routing (Sabour, Frosst & Hinton 2017) for PyTorch."""

__version__ = "0.1.0"

from .errors import CapsNetError, CheckpointError, ConfigError, DatasetError
from .layers import PrimaryCapsules, Router, RoutingResult, Squash, dynamic_routing, squash
from .losses import MarginLoss, capsule_lengths, reconstruction_loss
from .models import CapsNet, CapsNetConfig, CapsNetOutput, CapsuleDecoder
from .persist import load_pretrained

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
