"""capsnet: capsule networks for PyTorch: the papers' models and routing algorithms, each checked against its
authors' code (docs/fidelity.md; `capsnet models` lists them).

From raw images: `capsnet.preprocess(model, images)` is what `model(x)` takes, `capsnet.predict(model, images)`
classifies them and `capsnet.evaluate(model, data)` scores a data set (capsnet.inference, docs/inputs.md).

The names below load on first use (PEP 562), so `import capsnet` and the command line's parser stay light:
`capsnet.CapsNet` imports torch and the models the first time it is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes
from ._version import __version__
from .errors import CapsNetError, CheckpointError, ConfigError, DatasetError

if TYPE_CHECKING:
    from .configs.capsnet import CapsNetConfig
    from .inference import Ensemble, Prediction, evaluate, predict, preprocess
    from .models.capsnet import CapsNet, CapsNetOutput
    from .models.export import export_model
    from .models.factory import create_model, list_models
    from .models.pretrained import load_pretrained
    from .models.registry import register_model
    from .nn.decoder import CapsuleDecoder
    from .nn.losses import MarginLoss, capsule_lengths, reconstruction_loss
    from .nn.primary import PrimaryCapsules
    from .nn.squash import Squash, squash
    from .routing.dynamic import Router, RoutingResult, dynamic_routing
    from .training.api import fit
    from .viz.explore import explore

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "CapsNet": "models.capsnet",
    "CapsNetConfig": "configs.capsnet",
    "CapsNetOutput": "models.capsnet",
    "export_model": "models.export",
    "create_model": "models.factory",
    "load_pretrained": "models.pretrained",
    "list_models": "models.factory",
    "register_model": "models.registry",
    "CapsuleDecoder": "nn.decoder",
    "MarginLoss": "nn.losses",
    "capsule_lengths": "nn.losses",
    "reconstruction_loss": "nn.losses",
    "PrimaryCapsules": "nn.primary",
    "Squash": "nn.squash",
    "squash": "nn.squash",
    "Router": "routing.dynamic",
    "RoutingResult": "routing.dynamic",
    "dynamic_routing": "routing.dynamic",
    "fit": "training.api",
    "preprocess": "inference",
    "predict": "inference",
    "evaluate": "inference",
    "Prediction": "inference",
    "Ensemble": "inference",
    "explore": "viz.explore",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "CapsNet",
    "CapsNetConfig",
    "CapsNetError",
    "CapsNetOutput",
    "CapsuleDecoder",
    "CheckpointError",
    "ConfigError",
    "DatasetError",
    "Ensemble",
    "MarginLoss",
    "Prediction",
    "PrimaryCapsules",
    "Router",
    "RoutingResult",
    "Squash",
    "__version__",
    "capsule_lengths",
    "create_model",
    "dynamic_routing",
    "evaluate",
    "explore",
    "export_model",
    "fit",
    "list_models",
    "load_pretrained",
    "predict",
    "preprocess",
    "reconstruction_loss",
    "register_model",
    "squash",
]
