"""A training run put together before its first step: its folder, task, model, optimizer and schedule.

What a training run is made of, put together before its first step: the run folder opened with its task and the
state.pt to resume from (capsnet.training.runfolder), the model on its device (its data-dependent initialisation
done, then wrapped for DDP and torch.compile), Adam and its schedule, and the augmentation stream.

Two ways in: `build` makes the model from the registry name in a TrainConfig (what `capsnet train` does), and
`assemble` takes a model instance and any `capsnet.training.tasks.Task` (what `capsnet.fit` does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..config import from_dict, to_dict
from ..errors import ConfigError
from ..logs import LOGGER
from ..models.memory import check_memory
from ..models.pretrained import Pretrained
from ..models.registry import MODELS
from . import distributed as dist_utils
from . import runfolder
from .classification import ClassificationTask
from .config import FitConfig, TrainConfig, min_epoch_steps, own_data_options
from .ema import WeightAverage
from .tasks import Task


@dataclass
class Run:
    """What a run is made of (fixed for its whole length)."""

    config: TrainConfig | FitConfig
    model_config: Any  # the model's config dataclass; None for a module of the user's own without one
    device: torch.device
    dist: dist_utils.DistInfo
    task: Task
    model: nn.Module  # the model itself: saved, evaluated
    trained: nn.Module  # the module each step runs: task.wrap(model), maybe DDP- and compile-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.ExponentialLR
    augment_rng: torch.Generator  # this rank's augmentation stream, on the device
    dir: Path
    state_dict: dict | None = None  # the state.pt being resumed from (on the CPU; dropped once restored)
    step_graph: Any = None  # --cuda-graphs: the captured step (capsnet.training.graphs.StepGraph), or why not
    ema: WeightAverage | None = None  # --ema: the moving average of the model's weights


def make_adam(
    params: list[torch.nn.Parameter], *, lr: float, device: torch.device, capturable: bool = False
) -> torch.optim.Adam:
    """Adam, with PyTorch's fused kernel where it exists (CUDA; CPU since torch 2.4): the same update in one pass
    over memory instead of several. `capturable`: its step can be captured in a CUDA graph (capsnet.training.graphs)."""
    if device.type in ("cpu", "cuda"):
        try:
            return torch.optim.Adam(params, lr=lr, fused=True, capturable=capturable)
        except RuntimeError:  # an older torch without the fused kernel for this device
            pass
    return torch.optim.Adam(params, lr=lr, capturable=capturable)


def build(config: TrainConfig, model_config, device: torch.device, dist, task: Task | None) -> Run:
    """`capsnet train`'s run: the folder opened with its task (by default the classification recipe on
    config.dataset; capsnet.training.runfolder.open_run), the model from the registry name config.model (the saved
    one when resuming), then `assemble`."""
    model_class = MODELS[config.model]
    model_config, given = given_model_config(model_class, model_config, model=config.model)
    opened = runfolder.open_run(
        config,
        device,
        dist,
        make_task=lambda settled: task if task is not None else ClassificationTask.from_config(settled),
        model_settings={k: v for k, v in to_dict(model_config).items() if k in given},
        min_epoch_steps=min_epoch_steps(model_class),
    )
    try:
        return _build_model(opened, model_config, given, device, dist)
    except BaseException:
        runfolder.abandon(config.out)  # (nothing written yet: a folder this run made goes)
        raise


def given_model_config(model_class: type, model_config: Any, *, model: str) -> tuple[Any, frozenset[str]]:
    """(the model's config, the names of the fields the caller set): a config dataclass is taken as it is, every
    field set; a mapping sets its keys (checked as config.json's are) and leaves the rest at the defaults; None
    sets nothing."""
    config_class: Any = cast(Any, model_class).config_class
    if model_config is None:
        return config_class(), frozenset()
    if isinstance(model_config, dict):
        return from_dict(config_class, model_config, what=f"--model {model}"), frozenset(model_config)
    if not isinstance(model_config, config_class):
        raise ConfigError(f"model {model!r} takes a {config_class.__name__} or a dict of its fields")
    return model_config, frozenset(f.name for f in dataclasses.fields(model_config))


def _build_model(
    opened: runfolder.OpenedRun, model_config: Any, given: frozenset[str], device: torch.device, dist
) -> Run:
    """The registry model of an opened run: its config from the state.pt when resuming, the data's fields filled
    in, on one's own data the model's own-data options where `given` names none, its memory checked, then
    `assemble`."""
    config, task, saved = opened.config, opened.task, opened.saved
    assert isinstance(config, TrainConfig)
    run_dir = Path(config.out)
    model_class = MODELS[config.model]
    if saved is not None:  # the run's model is the one saved with it
        model_config = runfolder.saved_model_config(model_class, saved, run_dir, config.model)
    taken = {f.name for f in dataclasses.fields(model_config)}  # the data fields this model's config records
    fields = {k: v for k, v in task.model_fields().items() if k in taken}
    if saved is not None:
        runfolder.check_same_shape(model_config, fields, run_dir)
    model_config = dataclasses.replace(model_config, **fields)
    if saved is None and getattr(task, "own_data", False):
        chosen = {k: v for k, v in own_data_options(model_class).items() if k not in given}
        model_config = dataclasses.replace(model_config, **chosen)
        for key, value in chosen.items() if dist.is_main else ():
            flag = ("--no-" if value is True else "--") + key.replace("_", "-")  # (a switch: --pool / --no-pool)
            LOGGER.info(f"{key} {value} ({config.model}'s setting on data of one's own; set {flag} to change)")

    assert config.batch_size is not None  # resolved by open_run()
    if config.lr is None:  # the model's own for its configuration (`lr_for`; CapsNet's falls with more votes per class)
        config = dataclasses.replace(config, lr=model_class.lr_for(model_config))
        if dist.is_main and saved is None:
            LOGGER.info(f"lr {config.lr:g} ({config.model}'s default for its configuration; set --lr to change)")
    assert config.batch_size is not None
    check_memory(model_config, config.batch_size, device)  # one line with the fixes, before allocating anything
    torch.manual_seed(config.seed)
    model = model_class(config=model_config)
    return assemble(config, model, task, device, dist, saved=saved, model_config=model_config)


def assemble(
    config: TrainConfig | FitConfig,
    model: nn.Module,
    task: Task,
    device: torch.device,
    dist,
    *,
    saved: dict | None,
    model_config: Any = None,
) -> Run:
    """The run of `model` on `task`: the model moved to `device`, Adam and its schedule, the augmentation stream,
    the model's data-dependent initialisation (fresh runs only), then the DDP and torch.compile wrappers."""
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # (not in the stubs)
    capturable = config.cuda_graphs and device.type == "cuda" and not (config.compile or dist.enabled)  # (graphs.py)
    optimizer = make_adam(list(model.parameters()), lr=config.learning_rate, device=device, capturable=capturable)
    if device.type == "cuda" and config.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=config.decay_per_epoch)
    augment_rng = torch.Generator(device=device).manual_seed(config.seed * 1009 + dist.rank)

    trained = task.wrap(model)  # the module whose forward the loop runs (the model itself by default)
    if saved is None:  # (a resumed run's weights have it already)
        init_from_data(model, task, config, device, dist)
    ema = WeightAverage(model, decay=config.ema) if config.ema is not None else None  # (from the initialised weights)
    if dist.enabled:
        ids = [device] if device.type == "cuda" else None
        _match_grad_strides(model)
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=ids)
    if config.compile:
        trained = cast(torch.nn.Module, torch.compile(trained))
    return Run(
        config,
        model_config,
        device,
        dist,
        task,
        model,
        trained,
        optimizer,
        scheduler,
        augment_rng,
        Path(config.out),
        saved,
        ema=ema,
    )


def init_from_data(model: nn.Module, task: Task, config, device: torch.device, dist) -> None:
    """The model's data-dependent initialisation (`Pretrained.init_from_data`), to run before DDP wraps it:
    on a first batch that every rank computes alike (`Task.init_batch`), so that all ranks start from the
    same weights. Nothing for a model that needs none (a module of one's own: one with an `init_from_data`)."""
    hook = getattr(type(model), "init_from_data", None)
    if hook is None or hook is Pretrained.init_from_data:
        return
    assert config.batch_size is not None  # resolved by runfolder.open_run()
    first = task.init_batch(batch_size=config.batch_size, seed=config.seed, world_size=dist.world_size, device=device)
    if first is not None:  # (an epoch without batches trains nothing either)
        cast(Any, model).init_from_data(first.images)


def _match_grad_strides(model: torch.nn.Module) -> None:
    """Give each gradient its parameter's strides where they differ only in size-1 dimensions (the same memory
    layout; e.g. conv1's [out, 1, 9, 9] weight on 1-channel images, whose backward reports channel stride 1), so
    DDP's bucket views match and it neither warns nor copies."""
    for p in model.parameters():
        if p.requires_grad and 1 in p.shape and p.is_contiguous():
            p.register_hook(lambda g, p=p: g.as_strided(p.shape, p.stride()) if g.is_contiguous() else g)


__all__ = ["Run", "assemble", "build", "init_from_data", "make_adam"]
