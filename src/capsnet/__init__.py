"""capsnet: Capsule Networks with dynamic routing (Sabour, Frosst & Hinton 2017) for PyTorch."""

from ._version import __version__
from .errors import CapsNetError, CheckpointError, ConfigError, DatasetError
from .models.capsnet import CapsNet, CapsNetConfig, CapsNetOutput
from .models.export import export_model
from .models.factory import create_model
from .models.pretrained import load_pretrained
from .models.registry import list_models, register_model
from .nn.decoder import CapsuleDecoder
from .nn.losses import MarginLoss, capsule_lengths, reconstruction_loss
from .nn.primary import PrimaryCapsules
from .nn.squash import Squash, squash
from .routing.dynamic import Router, RoutingResult, dynamic_routing
from .training.fit import fit
from .viz.explore import explore

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
    "create_model",
    "dynamic_routing",
    "explore",
    "export_model",
    "fit",
    "list_models",
    "load_pretrained",
    "reconstruction_loss",
    "register_model",
    "squash",
]
