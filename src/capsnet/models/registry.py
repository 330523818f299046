"""The one model registry: `capsnet train --model NAME`, `capsnet models`, `create_model(NAME)` and the `model_type`
that config.json records all look names up here.

A model is registered in one line, `register_model(NAME, Class)`. Its class names its config dataclass
(`config_class`), the `model_type` its saved config.json records (an alias of NAME when it differs, so both load),
its default learning rate (`default_lr`), and `paper` / `designed_for` for `capsnet models`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, MutableMapping

from ..errors import ConfigError
from .baseline import BaselineCNN
from .capsnet import CapsNet
from .deepcaps import DeepCaps
from .efficient_capsnet import EfficientCapsNet
from .em_capsnet import EMCapsNet
from .hvc_capsnet import HVCCapsNet
from .inverted_attention_capsnet import InvertedAttentionCapsNet
from .pretrained import Pretrained
from .self_routing_capsnet import SelfRoutingCapsNet


class Registry(MutableMapping[str, type[Pretrained]]):
    """Model name -> model class. Iterating gives the canonical names in registration order; looking up (`[]`,
    `in`) also takes an alias, such as the `model_type` a class saves under when it differs from its name."""

    def __init__(self) -> None:
        self._models: dict[str, type[Pretrained]] = {}
        self._aliases: dict[str, str] = {}  # alias -> canonical name

    def register(self, name: str, cls: type[Pretrained], *, aliases: Iterable[str] = ()) -> type[Pretrained]:
        """Add `cls` under `name` (and `aliases`, plus its `model_type` if that differs); returns `cls`."""
        model_type = getattr(cls, "model_type", name)
        extra = [a for a in (*aliases, model_type) if a != name]
        for key in (name, *extra):
            owner = self._aliases.get(key, key if key in self._models else None)
            if owner is not None and owner != name:
                raise ValueError(f"model name {key!r} is taken by {owner!r}")
        self._models[name] = cls
        self._aliases.update(dict.fromkeys(extra, name))
        return cls

    def canonical(self, name: str) -> str:
        """The registered name for `name` (itself, or the model an alias stands for); ConfigError naming the known
        models otherwise."""
        name = self._aliases.get(name, name)
        if name not in self._models:
            raise ConfigError(f"unknown model {name!r}; known: {', '.join(self._models)}")
        return name

    def aliases(self, name: str) -> list[str]:
        return [alias for alias, target in self._aliases.items() if target == name]

    def __getitem__(self, name: str) -> type[Pretrained]:
        return self._models[self._aliases.get(name, name)]

    def __setitem__(self, name: str, cls: type[Pretrained]) -> None:
        self.register(name, cls)

    def __delitem__(self, name: str) -> None:
        del self._models[name]
        self._aliases = {alias: target for alias, target in self._aliases.items() if target != name}

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)


MODELS = Registry()
register_model = MODELS.register

register_model("capsnet", CapsNet)
register_model("baseline", BaselineCNN)  # saved as model_type "baseline-cnn": both names work
register_model("em-capsnet", EMCapsNet)
register_model("efficient-capsnet", EfficientCapsNet)
register_model("inverted-attention-capsnet", InvertedAttentionCapsNet)
register_model("self-routing-capsnet", SelfRoutingCapsNet)
register_model("hvc-capsnet", HVCCapsNet)
register_model("deepcaps", DeepCaps)


def model_class(name: str) -> type[Pretrained]:
    """The model class registered under `name` or one of its aliases; ConfigError naming the known ones otherwise."""
    return MODELS[MODELS.canonical(name)]


def list_models(pattern: str = "*", *, pretrained: bool = False) -> list[str]:
    """The registered model names, sorted: those matching the shell-style `pattern` (e.g. "*capsnet"), and with
    `pretrained=True` only those with shipped weights (:func:`capsnet.models.hub.shipped_tags`)."""
    from .hub import shipped_tags

    names = sorted(n for n in MODELS if fnmatch.fnmatchcase(n, pattern))
    return [n for n in names if shipped_tags(n)] if pretrained else names


__all__ = ["MODELS", "Registry", "list_models", "model_class", "register_model"]
