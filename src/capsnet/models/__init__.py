"""Published models, one module each, with `save_pretrained` / `from_pretrained`, the one registry of their names,
`create_model`, the weights shipped in the package (`hub`) and export to ONNX / torch.export (`export`).

May import: capsnet.nn, capsnet.routing and the foundation modules; never data, training or above.
"""

# Importing the model modules registers them (each class is decorated with @register_model), in this order.
# isort: off
from .capsnet import CapsNet, CapsNetConfig, CapsNetOutput
from .baseline import BaselineCNN, BaselineConfig
from .em_capsnet import EMCapsNet, EMCapsNetConfig, EMCapsNetOutput
from . import efficient_capsnet, inverted_attention_capsnet, self_routing_capsnet, hvc_capsnet, deepcaps
from . import heinsen_capsnet
from . import cluster_capsnet
from . import vb_capsnet
# isort: on

from .factory import create_model, list_models
from .pretrained import Pretrained, load_pretrained
from .registry import MODELS, model_class, register_model

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
    "cluster_capsnet",
    "create_model",
    "deepcaps",
    "efficient_capsnet",
    "heinsen_capsnet",
    "hvc_capsnet",
    "inverted_attention_capsnet",
    "list_models",
    "load_pretrained",
    "model_class",
    "register_model",
    "self_routing_capsnet",
    "vb_capsnet",
]
