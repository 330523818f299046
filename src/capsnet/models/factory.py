"""`create_model(NAME, *, pretrained=None, **overrides)`: any registered model, fresh or with weights, by name."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import warnings
from typing import Any

import torch

from ..config import from_dict, to_dict
from ..logs import LOGGER
from .hf_hub import is_hf_ref
from .hub import resolve_pretrained, shipped_tags
from .registry import MODELS


def create_model(name: str, *, pretrained: str | os.PathLike | None = None, **overrides: Any) -> Any:
    """The model registered as `name` (see `capsnet.list_models`).

    Without `pretrained`: freshly initialised, in training mode, its config the paper's defaults with `overrides`
    (config fields, e.g. `create_model("capsnet", in_channels=3, image_size=32, routing_iterations=1)`).

    With `pretrained`, a tag of the weights shipped for the model (`capsnet models` lists them), a save_pretrained
    folder, a training run folder (its best/), a published folder's URL#sha256=HEX or a Hugging Face Hub repository
    "hf-hub:ORG/REPO[@REVISION]": the saved model in eval mode, its `provenance` saying where it came from. The
    fields recorded from the training data (image size, channels, classes, ...) come from it; `overrides` may only
    change fields that keep the weights' shapes (e.g. routing_iterations). A bad name or option is a ConfigError
    naming the known ones.

    Fine-tuning to new classes: `n_classes=K` with K other than the weights' count loads every layer whose tensors'
    shapes do not depend on the class count (all but the class-capsule layer and the decoder's first layer),
    initialises those afresh for K classes, each as a whole (the class names are dropped) and says so in one line
    on stderr.
    """
    name = MODELS.canonical(name)
    cls = MODELS[name]
    if pretrained is not None:
        n_classes = overrides.pop("n_classes", None)
        source = pretrained if is_hf_ref(pretrained) else resolve_pretrained(name, pretrained)
        model = cls.from_pretrained(source, **overrides)
        model.provenance = {**model.provenance, "source": str(pretrained)}
        if n_classes is None or int(n_classes) == model.config.n_classes:
            return model
        fresh = with_classes(model, int(n_classes), source=str(pretrained))
        fresh.provenance = {**model.provenance, "n_classes": int(n_classes)}
        return fresh
    return cls(config=from_dict(cls.config_class, overrides, what=f"create_model({name!r})"))


def with_classes(model: Any, n_classes: int, *, source: str) -> Any:
    """A model of `model`'s class and config for `n_classes` classes: `model`'s weights in every layer whose tensors'
    shapes all agree, a fresh initialisation (the constructor's) for the other layers; one line on stderr names
    those."""
    cls = type(model)
    fields = {f.name for f in dataclasses.fields(model.config)}
    saved = {
        **to_dict(model.config),
        "n_classes": n_classes,
        **({"class_names": []} if "class_names" in fields else {}),
    }
    fresh = cls(config=from_dict(cls.config_class, saved, what=f"{source} with n_classes={n_classes}"))
    own, kept = fresh.state_dict(), model.state_dict()
    # A layer with any tensor of a new shape starts afresh as a whole (its bias too, whose shape may not change).
    renewed = sorted({k.rsplit(".", 1)[0] for k, v in own.items() if k not in kept or kept[k].shape != v.shape})
    loaded = {k: v for k, v in kept.items() if k in own and k.rsplit(".", 1)[0] not in renewed}
    with torch.no_grad():
        fresh.load_state_dict({**own, **loaded}, strict=True)
    LOGGER.warning(
        f"capsnet: {source}: {model.config.n_classes} classes -> {n_classes}: re-initialised "
        f"{', '.join(renewed)}; every other weight loaded"
    )
    return fresh.to(next(model.parameters()).device).eval()


__all__ = ["create_model"]


def list_models(pattern: str = "*", *, pretrained: bool = False) -> list[str]:
    """The registered model names, installed plugins' included, sorted: those matching the shell-style `pattern`
    (e.g. "*capsnet"), and with `pretrained=True` only those with shipped weights
    (`capsnet.models.hub.shipped_tags`). A plugin that fails to load is a warning naming it."""
    for line in MODELS.load_plugins():
        warnings.warn(line, stacklevel=2)
    names = sorted(n for n in MODELS if fnmatch.fnmatchcase(n, pattern))
    return [n for n in names if shipped_tags(n)] if pretrained else names
