"""The models `capsnet train --model NAME` knows, by their command-line name."""

from __future__ import annotations

from ..errors import ConfigError
from .baseline import BaselineCNN
from .capsnet import CapsNet
from .efficient_capsnet import EfficientCapsNet
from .em_capsnet import EMCapsNet
from .hvc_capsnet import HVCCapsNet
from .inverted_attention_capsnet import InvertedAttentionCapsNet
from .pretrained import Pretrained
from .self_routing_capsnet import SelfRoutingCapsNet

# Command-line name -> model class. Each class names its config dataclass (`config_class`), its `model_type`
# in config.json, its default learning rate (`default_lr`) and a one-line `summary` for `capsnet models`.
MODELS: dict[str, type[Pretrained]] = {"capsnet": CapsNet, "baseline": BaselineCNN, "em-capsnet": EMCapsNet}
# Issue 14: the other routing algorithms' published models (`paper` and `designed_for` class attributes).
MODELS.update({
    "efficient-capsnet": EfficientCapsNet,
    "inverted-attention-capsnet": InvertedAttentionCapsNet,
    "self-routing-capsnet": SelfRoutingCapsNet,
    "hvc-capsnet": HVCCapsNet,
})  # fmt: skip


def model_class(name: str) -> type[Pretrained]:
    """The model class registered under `name`; ConfigError naming the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
