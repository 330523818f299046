"""`save_pretrained` / `from_pretrained`: `config.json` + `model.safetensors`, strict, no pickle anywhere.

A model class mixes in `Pretrained`, names its config dataclass in `config_class`, a `model_type`
string, and takes `config=` in its constructor. `load_pretrained` loads any registered model
(`capsnet.models.registry`) by the `model_type` its config.json records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save
from torch.overrides import TorchFunctionMode

from .._version import __version__
from ..config import from_dict, parse_json, read_text_file, to_dict
from ..errors import CheckpointError, ConfigError
from ..fileio import atomic_write_bytes, atomic_write_json
from ..limits import MAX_PARAMETERS
from .inputs import DATA_FIELDS, RECORDED_SAVED_DEFAULTS

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
M = TypeVar("M", bound="Pretrained")

if TYPE_CHECKING:  # for the type checker, a Pretrained is the nn.Module it is always mixed into
    from torch.nn import Module as _ModuleBase
else:
    _ModuleBase = object


class StateDictError(CheckpointError, RuntimeError):
    """Weights that do not fit the model: a CheckpointError (one line from the CLI), and the RuntimeError that
    `nn.Module.load_state_dict` raises."""


class Pretrained(_ModuleBase):
    config_class: ClassVar[type]
    model_type: ClassVar[str]
    default_lr: ClassVar[float]
    # The fewest optimizer steps an epoch of one's own data (an image folder, a .npz, a Dataset) takes when the run
    # leaves epoch_repeats unset; None: the training loop's (capsnet.training.config.MIN_EPOCH_STEPS).
    own_data_epoch_steps: ClassVar[int | None] = None
    # Config values a run on one's own data takes where the caller sets none (its defaults describe the paper's data
    # set): capsnet.training.config.own_data_options reads them, `capsnet train` and `train` apply them.
    own_data_options: ClassVar[dict[str, Any]] = {}
    # Values for config keys a saved config.json may lack because it was written before they existed: the ones that
    # rebuild the model it was saved from (the dataclass defaults describe the current, paper layout).
    saved_defaults: ClassVar[dict[str, Any]] = {}
    config: Any
    # Where a loaded model's weights came from ({"source": what was given, "folder": the folder read}; from the Hub
    # also "repo", "revision", "commit", "pinned": capsnet.models.hf_hub); None for a model built afresh.
    provenance: dict[str, Any] | None = None

    @classmethod
    def lr_for(cls, config: Any) -> float:
        """Adam's learning rate for a model of `config` when none is given: `default_lr`, the paper's (a model
        whose right rate depends on its size overrides this; CapsNet and DeepCaps do)."""
        return cls.default_lr

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A model whose config records its training data reads an older config.json's missing data fields as
        they were then (RECORDED_SAVED_DEFAULTS), besides its own `saved_defaults`."""
        super().__init_subclass__(**kwargs)
        config_class = getattr(cls, "config_class", None)
        names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
        recorded = {k: v for k, v in RECORDED_SAVED_DEFAULTS.items() if k in names}
        cls.saved_defaults = {**recorded, **cls.saved_defaults}

    def init_from_data(self, images: torch.Tensor) -> None:
        """Data-dependent initialisation from one batch of training images [B, C, H, W] in [0, 1], before training
        starts. A no-op unless the model needs one (`capsnet.models.em_capsnet.EMCapsNet` centres its β_a).
        `capsnet train` calls it once, before DistributedDataParallel wraps the model, on a batch that every rank
        computes alike (so all start from the same weights); never on a resumed run, whose weights have it."""

    @classmethod
    def make_config(cls, config: Any = None, options: dict[str, Any] | None = None) -> Any:
        """The model's config: `config` as given, or `config_class(**options)`; both at once is a TypeError."""
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        return config if config is not None else cls.config_class(**(options or {}))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`, but weights that do not fit raise `StateDictError` in one line."""
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except StateDictError:
            raise
        except RuntimeError as e:
            raise StateDictError(f"weights do not fit this {type(self).__name__}: {_first_problems(str(e))}") from None

    def save_pretrained(self, directory: str | os.PathLike, *, metadata: dict[str, Any] | None = None) -> Path:
        """Write `config.json` and `model.safetensors` into `directory`, each atomically. `metadata` (JSON-ready)
        is kept in config.json under "checkpoint" (a training run records there which epoch the folder holds)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        atomic_write_bytes(directory / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
        meta = {"model_type": self.model_type, "capsnet_version": __version__, "config": to_dict(self.config)}
        plugins = plugin_distributions(self)
        if plugins:  # named again if the folder is loaded where they are not installed
            meta["plugins"] = plugins
        if metadata is not None:
            meta["checkpoint"] = metadata
        atomic_write_json(directory / CONFIG_NAME, meta)
        return directory

    @classmethod
    def from_pretrained(
        cls: type[M], directory: str | os.PathLike, *, map_location: str | torch.device = "cpu", **overrides: Any
    ) -> M:
        """Load a folder written by `save_pretrained` (or "NAME:TAG", shipped weights): strict state-dict match,
        returned in `.eval()` mode.

        `overrides` change config fields that leave the weights' shapes alone (e.g. `routing_iterations`); one that
        changes the architecture, or a field recorded from the training data (DATA_FIELDS), is a ConfigError."""
        directory, source = _folder(directory)
        model_type, saved, plugins = _read_config(directory)
        try:
            target = cls if model_type == getattr(cls, "model_type", None) else _registered(model_type, directory)
            if cls is not Pretrained and not issubclass(target, cls):
                raise CheckpointError(f"{directory}: holds a {model_type!r} model, not a {cls.__name__}")
            saved = {**target.saved_defaults, **saved}
            config: Any = from_dict(target.config_class, saved, what=f"{directory}/{CONFIG_NAME}")
        except (CheckpointError, ConfigError) as e:
            if not plugins:
                raise
            used = ", ".join(plugins)
            raise type(e)(f"{e} (the folder was saved with the plugin distribution {used}: is it installed?)") from None
        if overrides:
            config = _override(target, config, overrides)
        check_model_size(target, config, f"{directory}/{CONFIG_NAME}")
        model = target(config=config)
        path = directory / WEIGHTS_NAME
        state = _read_weights(path)
        problems = _dtype_problem(model, state) or _load_problems(model, state)
        if problems and overrides:
            given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
            raise ConfigError(f"{given} changes the architecture of the weights in {directory} ({problems})")
        if problems:
            raise StateDictError(f"{path}: weights do not match {CONFIG_NAME} ({problems})")
        model.provenance = {**source, "folder": str(directory)}
        return cast(M, model.to(map_location).eval())  # `target` is `cls` or a subclass of it

    def push_to_hub(self, repo_id: str, *, card: dict[str, Any] | None = None, **options: Any) -> dict[str, str]:
        """Publish this model on the Hugging Face Hub as repository `repo_id` (ORG/NAME, created if need be):
        config.json, model.safetensors and a README.md model card made from `card` (card.json's fields; None: a
        card that claims no figure), in one commit. `options`: revision (a branch), private, token,
        commit_message. Returns {"repo", "commit", "url", "ref"}: `ref` loads it back, pinned to the commit
        (capsnet.models.hf_hub; the `hub` extra)."""
        from .hf_hub import check_repo_id, push_folder
        from .model_card import render_card

        check_repo_id(repo_id, what="push_to_hub")
        with tempfile.TemporaryDirectory(prefix="capsnet-push-") as tmp:
            self.save_pretrained(tmp)
            text = render_card(card, repo_id=repo_id, model_type=self.model_type, config_file=Path(tmp) / CONFIG_NAME)
            return push_folder(tmp, repo_id, card_text=text, **options)


def load_pretrained(directory: str | os.PathLike, *, map_location: str | torch.device = "cpu", **overrides: Any) -> Any:
    """Load any registered model (CapsNet, BaselineCNN, ...) from its `save_pretrained` folder, shipped weights
    by "NAME:TAG" (e.g. "capsnet:fashion-mnist"), a published folder by URL#sha256=HEX (capsnet.models.hub) or a
    Hugging Face Hub repository by "hf-hub:ORG/REPO[@REVISION]" (capsnet.models.hf_hub); `overrides` as
    `Pretrained.from_pretrained`. The model's `provenance` says where it came from."""
    load = Pretrained.from_pretrained.__func__  # type: ignore[attr-defined]
    return load(Pretrained, directory, map_location=map_location, **overrides)


def _folder(directory: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The folder `directory` names (a folder, NAME:TAG, a URL, an hf-hub: reference) and its provenance."""
    from .hf_hub import fetch_hf, is_hf_ref
    from .hub import fetch_pretrained, is_ref, is_url, resolve_ref

    if is_hf_ref(directory):
        return fetch_hf(str(directory))
    source = {"source": str(directory)}
    if is_url(directory):
        return fetch_pretrained(str(directory)), source
    if isinstance(directory, str) and is_ref(directory):
        return resolve_ref(directory), source
    return Path(directory), source


def lightning_hint(path: Path) -> str:
    """What to do with a Lightning checkpoint (a .ckpt file, or a folder of them) given where a capsnet folder is
    expected, as the end of a message; "" for anything else."""
    found = (path.suffix == ".ckpt" and path.is_file()) or (path.is_dir() and any(path.glob("*.ckpt")))
    if not found:
        return ""
    return (
        "; a Lightning checkpoint: load it with capsnet.lightning.CapsuleModule.load_from_checkpoint(PATH) and "
        "write its .model with save_pretrained(FOLDER)"
    )


class _ShapesOnly(TorchFunctionMode):
    """normal_ (the tensor method and nn.init's) as a no-op, for a model built on the meta device to count its
    parameters: the meta form of normal_ lives in torch._refs, whose first use imports torch._dynamo (1.5 s of each
    process that loads a model)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.normal_ or func is torch.nn.init.normal_:
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def check_model_size(target: type, config: Any, where: str) -> None:
    """ConfigError if the model `config` describes has more than MAX_PARAMETERS parameters; counted on PyTorch's
    meta device (shapes, no memory), before the model is built for real."""
    try:
        with torch.device("meta"), _ShapesOnly():
            count = sum(p.numel() for p in target(config=config).parameters())
    except (ValueError, TypeError, RuntimeError, ConfigError) as e:
        raise ConfigError(f"{where}: does not describe a {target.__name__} ({e})") from None
    if count > MAX_PARAMETERS:
        raise ConfigError(
            f"{where}: describes a model of {count:,} parameters, more than the limit of "
            f"{MAX_PARAMETERS:,} (MAX_PARAMETERS)"
        )


def _registered(model_type: str, directory: Path) -> type[Pretrained]:
    """The registered model class of `model_type` (a name, an alias or an installed plugin's model);
    CheckpointError naming the known ones, or the missing plugin, otherwise."""
    from .registry import MODELS

    try:
        return MODELS[MODELS.canonical(model_type)]
    except ConfigError as e:
        raise CheckpointError(f"{directory}/{CONFIG_NAME}: model_type {model_type!r}: {e}") from None


def _override(target: type[Pretrained], config: Any, overrides: dict[str, Any]) -> Any:
    """`config` with `overrides`, keeping the fields recorded from the training data: ConfigError for an unknown
    option or a changed data field."""
    fields = [f.name for f in dataclasses.fields(config) if f.init]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"{target.__name__}: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    saved = to_dict(config)
    for key in overrides:
        if key in DATA_FIELDS and json.loads(json.dumps(overrides[key])) != saved[key]:  # (tuples as lists)
            raise ConfigError(
                f"{key}={overrides[key]!r}: the pretrained weights record {key}={getattr(config, key)!r} from their "
                "training data; it cannot be overridden"
            )
    return from_dict(target.config_class, {**saved, **overrides}, what=f"{target.__name__} options")


def _load_problems(model: Any, state: dict[str, torch.Tensor]) -> str | None:
    """Load `state` into `model` strictly; None if it fits, else its problems in one line."""
    try:
        torch.nn.Module.load_state_dict(model, state, strict=True)
    except RuntimeError as e:
        return _first_problems(str(e))
    return None


def _first_problems(message: str, keep: int = 2) -> str:
    """nn.Module.load_state_dict's multi-line message as one line: its first `keep` problems and how many more."""
    lines = [line.strip() for line in message.strip().splitlines()]
    problems = [line.rstrip(".") for line in lines[1:] if line] or lines[:1]
    more = f" (and {len(problems) - keep} more)" if len(problems) > keep else ""
    return "; ".join(problems[:keep]) + more


def plugin_distributions(model: Any) -> list[str]:
    """The installed plugin distributions ("name version") whose code `model` runs: those that declare a capsnet
    entry point (capsnet.plugins) and provide the module of one of its layers' classes."""
    from ..plugins import plugin_modules

    owners = plugin_modules()
    packages = {type(layer).__module__.split(".")[0] for layer in model.modules()}
    return sorted({owners[p] for p in packages if p in owners})


def _read_config(directory: Path) -> tuple[str, dict[str, Any], list[str]]:
    path = directory / CONFIG_NAME
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a folder{lightning_hint(directory)}")
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_NAME} (not a save_pretrained folder)")
    try:
        meta = parse_json(read_text_file(path, what=CONFIG_NAME), path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if isinstance(meta, dict) and "module" in meta and "model_type" not in meta:
        raise CheckpointError(
            f"{path}: the weights of a module of one's own ({meta['module']}), not a capsnet model; "
            "load them with model.load_state_dict(safetensors.torch.load_file(...))"
        )
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict) or "model_type" not in meta:
        hint = "; a training run folder? give its best/ or last/" if isinstance(meta, dict) and "train" in meta else ""
        raise CheckpointError(f"{path}: expected keys 'model_type' and 'config'{hint}")
    if not isinstance(meta["model_type"], str):
        raise CheckpointError(f"{path}: model_type must be a string, got {type(meta['model_type']).__name__}")
    plugins = meta.get("plugins", [])
    return meta["model_type"], meta["config"], [str(p) for p in plugins] if isinstance(plugins, list) else []


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a model.safetensors: floating point and finite (weights cast to integers or holding NaN
    would load and predict nonsense), else a CheckpointError. A file that cannot be opened is its OSError."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    with open(path, "rb"):  # (no permission: the OSError naming the path, not "missing")
        pass
    try:
        state = load_file(str(path))  # safetensors: raw tensors and a JSON header, never pickle
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: {name} holds NaN or infinite values")
    return state


def _dtype_problem(model: Any, state: dict[str, torch.Tensor]) -> str | None:
    """The first tensor of `state` whose kind (floating point or integer) is not that of the model's entry: weights
    cast to int8 would load (load_state_dict casts) and compute nonsense."""
    own = torch.nn.Module.state_dict(model)
    for name, tensor in state.items():
        if name in own and tensor.is_floating_point() != own[name].is_floating_point():
            got, want = (str(t.dtype).removeprefix("torch.") for t in (tensor, own[name]))
            return f"{name} holds {got}, the model's is {want}"
    return None


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "ConfigError", "Pretrained", "StateDictError", "load_pretrained"]
