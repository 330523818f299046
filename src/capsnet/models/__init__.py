"""Published models, one module each, with `save_pretrained` / `from_pretrained` and the registry the CLI lists.

May import: capsnet.nn, capsnet.routing and the foundation modules; never data, training or above.
"""

from .baseline import BaselineCNN, BaselineConfig
from .capsnet import CapsNet, CapsNetConfig, CapsNetOutput
from .em_capsnet import EMCapsNet, EMCapsNetConfig, EMCapsNetOutput
from .pretrained import Pretrained, load_pretrained
from .registry import MODELS, model_class

__all__ = [
    "MODELS",
    "BaselineCNN",
    "BaselineConfig",
    "CapsNet",
    "CapsNetConfig",
    "CapsNetOutput",
    "EMCapsNet",
    "EMCapsNetConfig",
    "EMCapsNetOutput",
    "Pretrained",
    "load_pretrained",
    "model_class",
]
