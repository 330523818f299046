"""The ways into training: `capsnet.fit` (any model on any data), `train` (a TrainConfig) and `resume` (a run folder).

`train(config)` is what `capsnet train` runs: the paper's MNIST recipe (§4) by default, resumable, kill-safe and
scalable with torchrun; `resume(out)` continues a run with its recorded settings. Both, and `fit`, build a run
(capsnet.training.build) and hand it to the loop (capsnet.training.loop.run_loop).

`capsnet.fit(model, train_data, *, epochs, out, ...)` trains any capsnet model, or an `nn.Module` of one's own.

The model is any capsnet model (`capsnet.create_model(...)`) or an `nn.Module` of one's own that follows the
protocol every capsnet model follows:

    out = model(images, labels=None)        # images [B, C, H, W]; out.predictions: class indices [B]
    loss, parts = model.loss(out, images, labels)   # a scalar tensor to minimise, and its parts (any)

and, optionally, `model.init_from_data(images)`: a data-dependent initialisation, called once on a first training
batch before training starts (never on a resumed run). At test time the model is called without labels.

The data (capsnet.training.loader) is a Dataset of (image, label) examples or an iterable of (images, labels)
batches. The run is `capsnet train`'s: Adam with the stretched exponential schedule, the
run folder (config.json, summary.csv, best/ chosen on validation, last/, test.json scored once at the end, state.pt
written first as the commit point), progress, TensorBoard, SIGINT/SIGTERM, torchrun, bf16, torch.compile.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..config import to_dict
from ..errors import ConfigError, DatasetError
from ..logs import LOGGER, warnings_only
from ..models.inputs import image_hw
from ..models.memory import check_memory
from ..models.pretrained import Pretrained
from ..models.recipe import recipe_of
from . import distributed as dist_utils
from .build import Run, assemble, build
from .checkpoint import model_name
from .config import FitConfig, TrainConfig, TrainResult, min_epoch_steps, own_data_options
from .hardware import rank_device, resolve_device
from .loader import LoaderTask
from .loop import run_loop
from .record import resumed_configs, split_changes
from .runfolder import abandon, open_run, release
from .tasks import Task

PROTOCOL = (
    "forward(images, labels=None) returning an object with .predictions [B], and loss(out, images, labels) "
    "returning (loss, parts)"
)


def train(
    config: TrainConfig,
    model_config: Any = None,
    *,
    on_step: Callable[[int], bool] | None = None,
    task: Task | None = None,
) -> TrainResult:
    """Train a model as `config` says; returns when done or when a stop was asked for.

    `model_config` is the model's config dataclass, taken as it is, or a dict of the options you set (as
    `capsnet train`'s model flags): the others are the model's defaults, and on one's own data (an image folder, a
    .npz) its `own_data_options` (`capsnet models --json`).

    `on_step(global_step)` is called after every optimizer step; returning True stops training with a
    checkpoint, as SIGINT and SIGTERM do. `task` supplies the batches, loss and test metrics; by default the
    MNIST classification recipe on `config.dataset` (its dataset, subset and shift fields).

    Resuming (`config.resume`), `config` must agree with the run's recorded settings but for what may change
    (capsnet.training.record.MAY_CHANGE); its unset (None) fields are the run's. `resume` takes them all from
    the run.
    """
    return launch(config, lambda device, dist: build(config, model_config, device, dist, task), on_step)


def resume(out: str | Path, *, on_step: Callable[[int], bool] | None = None, **changes: Any) -> TrainResult:
    """Continue the `capsnet train` run in `out` with its own recorded settings (config.json), as
    `capsnet train --out OUT --resume` does. `changes` are TrainConfig fields or model options given again: each
    must agree with the record unless it may change on resume (e.g. epochs=20, device="cuda"; see
    capsnet.training.record.MAY_CHANGE); otherwise a ConfigError names it and both values."""
    config, model_config = resumed_configs(out, *split_changes(changes))
    return train(config, model_config, on_step=on_step)


def launch(config: TrainConfig | FitConfig, make_run: Callable[..., Run], on_step) -> TrainResult:
    """Join torchrun's process group (when launched by it) on this rank's device, build the run there with
    `make_run(device, dist)` and train it (`run_loop`); at the end, let go of the run folder's lock and
    leave the group."""
    dist = dist_utils.from_env()
    device = rank_device(resolve_device(config.device), dist)
    dist = dist_utils.setup(device, dist)  # on CUDA: set_device first, then NCCL
    try:
        run = make_run(device, dist)  # (a make_run that fails lets go of the folder itself)
        try:
            return run_loop(run, on_step)
        finally:
            release(run.dir)
    finally:
        dist_utils.teardown(dist)


def fit(
    model: nn.Module,
    train_data: Any,
    *,
    epochs: int,
    out: str | os.PathLike,
    epoch_repeats: int | None = None,
    val_data: Any = None,
    test_data: Any = None,
    val_fraction: float = 0.1,
    val_seed: int = 0,
    batch_size: int | None = None,
    eval_batch_size: int = 250,
    lr: float | None = None,
    lr_decay: float | None = None,
    lr_end: float | None = None,
    seed: int = 0,
    monitor: str | None = None,
    ema: float | None = None,
    stop_at_val_acc: float | None = None,
    workers: int = 0,
    device: str = "auto",
    precision: Literal["fp32", "bf16"] = "fp32",
    compile: bool = False,
    channels_last: bool = False,
    progress: bool = True,
    tensorboard: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    on_step: Callable[[int], bool] | None = None,
    digits: bool | None = None,
) -> TrainResult:
    """Train `model` on `train_data` for `epochs` into the run folder `out`; returns the run's TrainResult.

    The model is trained in place (it ends with the last epoch's weights; `out/best/` holds the chosen ones).
    `val_data` chooses best/; without it a Dataset gives a seeded, stratified `val_fraction` of its examples
    (`val_seed`), and an iterable gives none (best/ is then chosen on `test_data`, or on the training loss).
    `test_data` is scored once, at the end, on best/ and last/ (test.json). `epoch_repeats`: passes over a Dataset in
    one epoch; unset, the fewest that make an epoch at least 200 steps, or the model's `own_data_epoch_steps`
    (capsnet.training.config.min_epoch_steps: a small set's epochs are otherwise too few steps for the per-epoch
    learning-rate decay). `batch_size` (per process; default 16 on CPU, 128 on CUDA) and `workers` (DataLoader
    processes) apply to a Dataset; an iterable batches for itself.
    `lr` defaults to the model's (1e-3 for a module of one's own); the learning rate decays each epoch by `lr_decay`,
    or down to lr × `lr_end` in the last epoch; with neither, by the model's `default_lr_decay` where it has one,
    else to lr × 0.25. Giving both is a ConfigError. `monitor` chooses best/ (capsnet.training.selection: "val_loss",
    the default, "val_accuracy", or "val_accuracy,val_loss"); `ema` (a decay, e.g. 0.999) keeps a moving average of
    the weights, scored beside them each epoch, and best/ may hold it (capsnet.training.ema). `stop_at_val_acc`
    (e.g. 1.0) ends the run after the first epoch whose validation accuracy reaches it (0: never, which a resumed
    run may give to train on past a recorded threshold). `on_step(step)` returning True stops with a checkpoint, as
    SIGINT and SIGTERM do. `progress=False`: no progress bar and no information lines (the `capsnet` logger shows
    warnings only while it runs).

    Every batch reaches the model through its input recipe (capsnet.models.recipe): raw uint8 pixels or floats in
    [0, 1] become what it records (÷ 255 for a fresh model; a pretrained one's own scaling). `digits` records
    whether the images are digit-style ink images (white on black in a 20/28 box, as MNIST's), which `capsnet
    predict` then converts image files to; a Dataset gives no way to know, so None (the default) keeps what the
    model records: False for a fresh model, True for shipped digit weights being fine-tuned.

    `resume=True` continues the run in `out`: from the batch where it stopped for a Dataset, or from the start of the
    first unfinished epoch for an iterable. The model and data are given again; the settings must be the run's
    (the epochs, device, precision, progress, ... may change: capsnet.training.record.MAY_CHANGE). `overwrite=True`
    deletes the run already in `out` (a capsnet run's folder only) and starts afresh; without it a finished run
    there is never touched.

    A Dataset with a `classes` list (as torchvision's ImageFolder has) names the model's classes (its config's
    `class_names`), so predictions print names. `lr` unset is the model's own default for its configuration
    (`lr_for`: CapsNet's and DeepCaps' depend on their number of votes per class).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fit: model must be an nn.Module, got {type(model).__name__}")
    if not callable(getattr(model, "loss", None)):
        raise ConfigError(
            f"fit: {type(model).__name__} has no loss(out, images, labels) method; a model needs {PROTOCOL}"
        )
    cls = type(model)
    config = FitConfig(
        epochs=epochs,
        epoch_repeats=epoch_repeats,
        out=str(out),
        model=model_name(model),
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        lr=lr if lr is not None or resume else default_lr(model),  # (resuming, unset: the run's)
        lr_decay=lr_decay
        if lr_decay is not None or lr_end is not None or resume
        else getattr(cls, "default_lr_decay", None),
        lr_end=lr_end,
        val_fraction=val_fraction,
        val_seed=val_seed,
        monitor=monitor,
        ema=ema,
        stop_at_val_acc=stop_at_val_acc,
        seed=seed,
        workers=workers,
        device=device,
        precision=precision,
        compile=compile,
        channels_last=channels_last,
        progress=progress,
        tensorboard=tensorboard,
        resume=resume,
        overwrite=overwrite,
    )
    cfg = getattr(model, "config", None)
    if digits is not None and dataclasses.is_dataclass(cfg) and hasattr(cfg, "digits"):
        cfg.digits = bool(digits)  # what the model records of its data (capsnet predict reads it)
    names = dataset_classes(train_data)
    if names is not None and dataclasses.is_dataclass(cfg) and hasattr(cfg, "class_names") and not resume:
        n_classes = getattr(cfg, "n_classes", len(names))
        if len(names) != n_classes:
            raise DatasetError(
                f"train_data.classes names {len(names)} classes, the {cls.__name__} has {n_classes} "
                "(its config's n_classes)"
            )
        cfg.class_names = names  # what the model's predictions are called (capsnet predict prints them)
    if lr is None and not resume and progress:
        LOGGER.info(f"lr {config.lr:g} ({cls.__name__}'s default for its configuration; set lr= to change)")
    task = LoaderTask(
        train_data,
        val=val_data,
        test=test_data,
        val_fraction=config.val_fraction,
        val_seed=config.val_seed,
        workers=config.workers,
        recipe=recipe_of(model),
    )
    with warnings_only(not progress):  # progress=False: no bar and no information lines, warnings still
        return launch(config, lambda device, dist: _make_run(config, model, task, device, dist), on_step)


def default_lr(model: nn.Module) -> float:
    """Adam's learning rate for `model` when none is given: a capsnet model's own for its config (`lr_for`), else
    its class's `default_lr`, else 1e-3."""
    lr_for, cfg = getattr(type(model), "lr_for", None), getattr(model, "config", None)
    if callable(lr_for) and cfg is not None:
        return float(lr_for(cfg))
    return float(getattr(type(model), "default_lr", 1e-3))


def dataset_classes(data: Any) -> tuple[str, ...] | None:
    """The class names a Dataset carries as `classes` (torchvision's convention; through a Subset or a
    DataLoader's dataset too), or None."""
    for _ in range(3):
        classes = getattr(data, "classes", None)
        if isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) for c in classes):
            return tuple(classes)
        data = getattr(data, "dataset", None)
        if data is None:
            return None
    return None


def _make_run(config: FitConfig, model: nn.Module, task: LoaderTask, device: torch.device, dist) -> Run:
    model_config = getattr(model, "config", None)
    model_config = model_config if dataclasses.is_dataclass(model_config) else None

    def check_task(settled: FitConfig, task: LoaderTask) -> None:  # the data against the model, before the folder
        task.check_ranks(dist)
        assert settled.batch_size is not None  # resolved by open_run()
        if isinstance(model, Pretrained):
            check_memory(model_config, settled.batch_size, device)  # one line with the fixes, before allocating
        model.to(device)
        check_first_batch(model, task, batch_size=settled.batch_size, device=device)

    opened = open_run(
        config,
        device,
        dist,
        make_task=lambda settled: task,
        check_task=check_task,
        model_settings=to_dict(model_config) if model_config is not None else None,
        flag="resume=True",
        batches=task.source.indexed,
        min_epoch_steps=min_epoch_steps(type(model)),
    )
    if model_config is not None and opened.saved is None and task.own_data and dist.is_main:
        own_data_note(model, model_config)
    try:
        torch.manual_seed(opened.config.seed)  # dropout and the rest of the run's random numbers
        return assemble(opened.config, model, task, device, dist, saved=opened.saved, model_config=model_config)
    except BaseException:
        abandon(config.out)  # (nothing written yet: a folder this run made goes)
        raise


def own_data_note(model: nn.Module, model_config: Any) -> None:
    """Log the own-data options (capsnet.training.config.own_data_options) a model given to `fit` was built
    without: `fit` trains the model as it is, so the line says how to build it with them."""
    differ = {k: v for k, v in own_data_options(type(model)).items() if getattr(model_config, k, v) != v}
    if differ:
        name = getattr(model, "model_type", type(model).__name__)
        options = ", ".join(f"{k}={v!r}" for k, v in differ.items())
        LOGGER.warning(
            f"{name} learns data of one's own with {options} (its own_data_options; `capsnet train` sets them): "
            f"build it with create_model({name!r}, ..., {options})"
        )


@torch.no_grad()
def check_first_batch(model: nn.Module, task: LoaderTask, *, batch_size: int, device: torch.device) -> None:
    """One clear error, before training, for data the model cannot take or a model outside the protocol: a
    capsnet model's recorded input (channels, size, classes) against a first batch, then one forward pass and loss
    (in eval mode: no state changes) on up to 4 of its examples."""
    first = task.init_batch(batch_size=min(batch_size, 4), seed=0, world_size=1, device=device)
    if first is None:
        raise DatasetError("train_data yields no batches")
    images, labels = first.images[:4], first.targets[:4]
    cfg: Any = getattr(model, "config", None)
    if all(hasattr(cfg, k) for k in ("in_channels", "image_size", "n_classes")):
        want = (cfg.in_channels, *image_hw(cfg.image_size))
        if tuple(images.shape[1:]) != want:
            raise DatasetError(
                f"train_data: images are {'x'.join(map(str, images.shape[1:]))}, the "
                f"{type(model).__name__} expects {'x'.join(map(str, want))} (its config's "
                "in_channels and image_size)"
            )
        top = int(task.labels.max()) if task.labels is not None else int(labels.max())
        if top >= cfg.n_classes or int(labels.min()) < 0:
            raise DatasetError(
                f"train_data: labels go up to {top}, the {type(model).__name__} has {cfg.n_classes} "
                "classes (its config's n_classes)"
            )
    shapes = f"images {list(images.shape)} {str(images.dtype).replace('torch.', '')}, labels {list(labels.shape)}"
    name = type(model).__name__
    was_training = model.training
    model.eval()
    try:
        out = _call(lambda: model(images, labels), f"{name}(images, labels) failed on a first batch ({shapes})")
        predictions = getattr(out, "predictions", None)
        if not isinstance(predictions, torch.Tensor) or tuple(predictions.shape) != (len(labels),):
            got = list(predictions.shape) if isinstance(predictions, torch.Tensor) else "none"
            raise ConfigError(
                f"fit: {name}'s output has .predictions {got}, not class indices [{len(labels)}]; a "
                f"model needs {PROTOCOL}"
            )
        result = _call(lambda: model.loss(out, images, labels), f"{name}.loss(out, images, labels) failed")  # type: ignore[operator]
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[0], torch.Tensor)
            and result[0].dim() == 0
        ):
            raise ConfigError(f"fit: {name}.loss returned {type(result).__name__}, not (scalar loss tensor, parts)")
    finally:
        model.train(was_training)


def _call(fn: Callable[[], Any], what: str) -> Any:
    try:
        return fn()
    except Exception as e:  # the user's module: any error, as one line
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"fit: {what}: {type(e).__name__}: {line}" if line else f"fit: {what}: {type(e).__name__}"
        ) from None
