"""Published models, one module each, with `save_pretrained` / `from_pretrained`, the one registry of their names,
`create_model`, the weights shipped in the package (`hub`) and export to ONNX / torch.export (`export`).

May import: capsnet.nn, capsnet.routing and the foundation modules; never data, training or above.
"""

from .baseline import BaselineCNN, BaselineConfig
from .capsnet import CapsNet, CapsNetConfig, CapsNetOutput
from .em_capsnet import EMCapsNet, EMCapsNetConfig, EMCapsNetOutput
from .factory import create_model
from .pretrained import Pretrained, load_pretrained
from .registry import MODELS, list_models, model_class, register_model

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
    "create_model",
    "list_models",
    "load_pretrained",
    "model_class",
    "register_model",
]
