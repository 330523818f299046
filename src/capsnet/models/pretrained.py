"""`save_pretrained` / `from_pretrained`: `config.json` + `model.safetensors`, strict, no pickle anywhere.

A model class mixes in :class:`Pretrained`, names its config dataclass in `config_class`, a `model_type`
string, and takes `config=` in its constructor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from .._version import __version__
from ..config import from_dict, to_dict
from ..errors import CheckpointError, ConfigError
from ..fileio import atomic_write_bytes, atomic_write_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
M = TypeVar("M", bound="Pretrained")

_REGISTRY: dict[str, type[Pretrained]] = {}

if TYPE_CHECKING:  # for the type checker, a Pretrained is the nn.Module it is always mixed into
    from torch.nn import Module as _ModuleBase
else:
    _ModuleBase = object


class Pretrained(_ModuleBase):
    config_class: ClassVar[type]
    model_type: ClassVar[str]
    default_lr: ClassVar[float]
    # Values for config keys a saved config.json may lack because it was written before they existed: the ones that
    # rebuild the model it was saved from (the dataclass defaults describe the current, paper layout).
    saved_defaults: ClassVar[dict[str, Any]] = {}
    config: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "model_type" in cls.__dict__:
            _REGISTRY[cls.model_type] = cls

    def init_from_data(self, images: torch.Tensor) -> None:
        """Data-dependent initialisation from one batch of training images [B, C, H, W] in [0, 1], before training
        starts. A no-op unless the model needs one (:class:`capsnet.models.em_capsnet.EMCapsNet` centres its β_a).
        `capsnet train` calls it once, before DistributedDataParallel wraps the model, on a batch that every rank
        computes alike (so all start from the same weights); never on a resumed run, whose weights have it."""

    @classmethod
    def make_config(cls, config: Any = None, options: dict[str, Any] | None = None) -> Any:
        """The model's config: `config` as given, or `config_class(**options)`; both at once is a TypeError."""
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        return config if config is not None else cls.config_class(**(options or {}))

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write `config.json` and `model.safetensors` into `directory`, each atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        atomic_write_bytes(directory / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
        meta = {"model_type": self.model_type, "capsnet_version": __version__, "config": to_dict(self.config)}
        atomic_write_json(directory / CONFIG_NAME, meta)
        return directory

    @classmethod
    def from_pretrained(cls: type[M], directory: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> M:
        """Load a folder written by `save_pretrained`: strict state-dict match, returned in `.eval()` mode."""
        model_type, config = _read_config(Path(directory))
        target = cls if model_type == getattr(cls, "model_type", None) else _REGISTRY.get(model_type)
        if target is None or (cls is not Pretrained and not issubclass(target, cls)):
            raise CheckpointError(f"{directory}: holds a {model_type!r} model, not a {cls.__name__}")
        config = {**target.saved_defaults, **config}
        model = target(config=from_dict(target.config_class, config, what=f"{directory}/{CONFIG_NAME}"))
        _load_weights(model, Path(directory) / WEIGHTS_NAME)
        return cast(M, model.to(map_location).eval())  # `target` is `cls` or a subclass of it


def load_pretrained(directory: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Any:
    """Load any capsnet model (CapsNet, BaselineCNN, ...) from its `save_pretrained` folder."""
    return Pretrained.from_pretrained.__func__(Pretrained, directory, map_location=map_location)  # type: ignore[attr-defined]


def _read_config(directory: Path) -> tuple[str, dict[str, Any]]:
    path = directory / CONFIG_NAME
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a folder")
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_NAME} (not a save_pretrained folder)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "model_type" not in meta:
        raise CheckpointError(f"{path}: expected keys 'model_type' and 'config'")
    if meta["model_type"] not in _REGISTRY:
        raise CheckpointError(f"{path}: unknown model_type {meta['model_type']!r}; known: {sorted(_REGISTRY)}")
    return meta["model_type"], meta["config"]


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        state = load_file(str(path))  # safetensors: raw tensors and a JSON header, never pickle
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: weights do not match config.json ({' '.join(first[:3])})") from None


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "ConfigError", "Pretrained", "load_pretrained"]
