"""The models `capsnet train --model NAME` knows, by their command-line name."""

from __future__ import annotations

from ..errors import ConfigError
from .baseline import BaselineCNN
from .capsnet import CapsNet
from .pretrained import Pretrained

# Command-line name -> model class. Each class names its config dataclass (`config_class`), its `model_type`
# in config.json, its default learning rate (`default_lr`) and a one-line `summary` for `capsnet models`.
MODELS: dict[str, type[Pretrained]] = {"capsnet": CapsNet, "baseline": BaselineCNN}


def model_class(name: str) -> type[Pretrained]:
    """The model class registered under `name`; ConfigError naming the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
