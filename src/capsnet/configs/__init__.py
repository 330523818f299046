"""The config dataclasses of the built-in models, in torch-free modules (one per model), and what they share
(`capsnet.configs.base`). The models (capsnet.models) build from them; the command line's parser reads their
fields and help texts without importing torch.

May import: the foundation modules; never nn, routing, models or above.
"""

# The registration order is the order `capsnet models` and `--model` list the models in.
# isort: off
from . import capsnet, baseline, em_capsnet, efficient_capsnet
from . import inverted_attention_capsnet, self_routing_capsnet, hvc_capsnet, deepcaps, heinsen_capsnet, cluster_capsnet
from . import vb_capsnet
# isort: on

from .base import MODEL_CONFIGS, config_name

__all__ = [
    "MODEL_CONFIGS",
    "baseline",
    "capsnet",
    "cluster_capsnet",
    "config_name",
    "deepcaps",
    "efficient_capsnet",
    "em_capsnet",
    "heinsen_capsnet",
    "hvc_capsnet",
    "inverted_attention_capsnet",
    "self_routing_capsnet",
    "vb_capsnet",
]
