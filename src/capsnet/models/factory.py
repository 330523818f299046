"""`create_model(NAME, *, pretrained=None, **overrides)`: any registered model, fresh or with weights, by name."""

from __future__ import annotations

import fnmatch
import os
from typing import Any

from ..config import from_dict
from .hub import resolve_pretrained, shipped_tags
from .registry import MODELS


def create_model(name: str, *, pretrained: str | os.PathLike | None = None, **overrides: Any) -> Any:
    """The model registered as `name` (see :func:`capsnet.list_models`).

    Without `pretrained`: freshly initialised, in training mode, its config the paper's defaults with `overrides`
    (config fields, e.g. `create_model("capsnet", in_channels=3, image_size=32, routing_iterations=1)`).

    With `pretrained`, a tag of the weights shipped for the model (`capsnet models` lists them), a save_pretrained
    folder or a training run folder (its best/): the saved model in eval mode. The fields recorded from the
    training data (image size, channels, classes, ...) come from it; `overrides` may only change fields that keep
    the weights' shapes (e.g. routing_iterations). A bad name or option is a ConfigError naming the known ones.
    """
    name = MODELS.canonical(name)
    cls = MODELS[name]
    if pretrained is not None:
        return cls.from_pretrained(resolve_pretrained(name, pretrained), **overrides)
    return cls(config=from_dict(cls.config_class, overrides, what=f"create_model({name!r})"))


__all__ = ["create_model"]


def list_models(pattern: str = "*", *, pretrained: bool = False) -> list[str]:
    """The registered model names, sorted: those matching the shell-style `pattern` (e.g. "*capsnet"), and with
    `pretrained=True` only those with shipped weights (:func:`capsnet.models.hub.shipped_tags`)."""
    names = sorted(n for n in MODELS if fnmatch.fnmatchcase(n, pattern))
    return [n for n in names if shipped_tags(n)] if pretrained else names
