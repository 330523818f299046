"""`capsnet train`: the paper's MNIST recipe (§4), resumable, kill-safe, and scalable with torchrun.

Recipe (defaults): Adam, lr 1e-3 with exponential decay per epoch, stretched over the run so that the last epoch
trains at lr × lr_end; random shifts of up to 2 px (§5); margin loss (Eq. 4) + 0.0005 × the summed squared
reconstruction error, the decoder masked by the true label (§4.1).

What is trained on comes from a :class:`capsnet.training.tasks.Task` (the MNIST recipe by default; MultiMNIST and
expanded MNIST in :mod:`capsnet.experiments`); `model` chooses the network from the model registry.

The training step never waits for the device: the loss, the correct count and their sums stay device tensors,
read once per epoch and, for the progress bar, at most twice a second. Under torchrun, whether any rank was asked
to stop (SIGINT, SIGTERM, `on_step`) is agreed on every STOP_CHECK_EVERY steps and at the end of each epoch (one
small all-reduce), so a stop takes effect within STOP_CHECK_EVERY steps; a single process stops at the next step.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file

from ..config import from_dict
from ..errors import ConfigError
from ..fileio import atomic_write_json
from ..models.pretrained import WEIGHTS_NAME, Pretrained
from ..models.registry import MODELS
from . import distributed as dist_utils
from . import graphs
from .checkpoint import STATE_NAME, TEST_NAME, load_state, remove_strays
from .config import DATA_FIELDS, TrainConfig, TrainResult
from .hardware import default_batch_size, precision_note, rank_device, resolve_device
from .memory import check_memory
from .profiling import phase
from .progress import _Logger, _StopFlag
from .state import EpochSums, RunState, check_validation, restore, resumed_validation, save_checkpoint
from .tasks import Batch, ClassificationTask, Task

__all__ = ["DATA_FIELDS", "TrainConfig", "TrainResult", "make_adam", "resolve_device", "train"]

STOP_CHECK_EVERY = 16  # steps between the torchrun ranks' agreement on a stop (one all-reduce + one host sync)


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


# ----------------------------------------------------------------------------------------------- the run
def train(
    config: TrainConfig,
    model_config: Any = None,
    *,
    on_step: Callable[[int], bool] | None = None,
    task: Task | None = None,
) -> TrainResult:
    """Train a model as `config` says; returns when done or when a stop was asked for.

    `on_step(global_step)` is called after every optimizer step; returning True stops training with a
    checkpoint, as SIGINT and SIGTERM do. `task` supplies the batches, loss and test metrics; by default the
    MNIST classification recipe on `config.dataset` (its dataset, subset and shift fields).
    """
    dist = dist_utils.from_env()
    device = rank_device(resolve_device(config.device), dist)
    dist = dist_utils.setup(device, dist)  # on CUDA: set_device first, then NCCL
    try:
        return _train(config, model_config, device, dist, on_step, task)
    finally:
        dist_utils.teardown(dist)


def _train(config, model_config, device, dist, on_step, task) -> TrainResult:
    run = build(config, model_config, device, dist, task)
    if dist.is_main:
        remove_strays(run.dir)  # what a kill of an earlier attempt left
    state = restore(run) if config.resume else RunState(sums=EpochSums.zeros(device))
    log = _Logger(run.dir, run.config, dist.is_main)
    log.start(run, state)
    stop = False
    with _StopFlag() as signals:
        while state.epoch < run.config.epochs and not stop:
            stop = train_epoch(run, state, log, signals, on_step)
            if stop:  # stopped mid-epoch: save where we are
                save_checkpoint(run, state, epoch_done=False)
                break
            row = evaluate_epoch(run, state)
            save_checkpoint(run, state, epoch_done=True)
            log.epoch(row)
            state.next_epoch()
            more = state.epoch < run.config.epochs
            stop = more and stop_requested(run, signals, state.stop_asked)  # asked for during the evaluation
    test = None
    if not stop:  # finished (or resumed after its last epoch): the test split, once
        test = final_test(run, state)
        log.tested(test)
    log.finish(stop, signals.signum, state.epoch, state.batch_in_epoch)
    dist_utils.barrier(dist)
    return TrainResult(run.dir, state.epoch, state.history, dict(state.best), test, stop, signals.signum,
                       dist.is_main)  # fmt: skip


# ----------------------------------------------------------------------------------------------- build
@dataclass
class Run:
    """What a run is made of (fixed for its whole length)."""

    config: TrainConfig
    model_config: Any
    device: torch.device
    dist: dist_utils.DistInfo
    task: Task
    model: Pretrained  # the model itself: saved, evaluated
    trained: torch.nn.Module  # the module each step runs: task.wrap(model), maybe DDP- and compile-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.ExponentialLR
    augment_rng: torch.Generator  # this rank's augmentation stream, on the device
    dir: Path
    state_dict: dict | None = None  # the state.pt being resumed from (on the CPU; dropped once restored)
    step_graph: Any = None  # --cuda-graphs: the captured step (capsnet.training.graphs.StepGraph), or why not


def build(config: TrainConfig, model_config, device: torch.device, dist, task: Task | None) -> Run:
    """Check the run folder, build the task, the model (the saved one when resuming), optimizer and schedule."""
    run_dir = Path(config.out)
    has_state = (run_dir / STATE_NAME).is_file()
    if has_state and not config.resume:
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or choose another --out")
    if config.resume and not has_state:
        raise ConfigError(f"--resume: {run_dir} holds no {STATE_NAME} to continue from")
    if config.batch_size is None:  # the model's recipe, else the device's default (capsnet.training.hardware)
        recipe = getattr(MODELS[config.model], "default_batch_size", None)
        config = dataclasses.replace(config, batch_size=recipe or default_batch_size(device))
        if dist.is_main:
            whose = f"{config.model}'s recipe" if recipe else f"the {device.type} defaults"
            print(
                f"batch size {config.batch_size} per process, lr {config.learning_rate:g} ({whose}; set "
                "--batch-size and --lr to change)",
                flush=True,
            )
    note = precision_note(device, config.precision)
    if note and dist.is_main:
        print(note, file=sys.stderr, flush=True)

    saved = load_state(run_dir) if config.resume else None  # on the CPU: restore() copies what it needs
    if saved is not None and task is None:
        config = resumed_validation(config, saved)
    task = task if task is not None else ClassificationTask.from_config(config)
    if saved is not None:
        check_validation(task, saved, run_dir)
    model_class = MODELS[config.model]
    if saved is not None:  # the run's model is the one saved with it
        saved_config = {**getattr(model_class, "saved_defaults", {}), **saved["model_config"]}  # older runs' keys
        model_config = from_dict(model_class.config_class, saved_config, what=f"{run_dir}/{STATE_NAME}")
    if model_config is not None and not isinstance(model_config, model_class.config_class):
        raise ConfigError(f"model {config.model!r} takes a {model_class.config_class.__name__}")
    model_config = model_config or model_class.config_class()
    taken = {f.name for f in dataclasses.fields(model_config)}  # the data fields this model's config records
    model_config = dataclasses.replace(model_config, **{k: v for k, v in task.model_fields().items() if k in taken})

    assert config.batch_size is not None  # the device's default was filled in above
    check_memory(model_config, config.batch_size, device)  # one line with the fixes, before allocating anything
    torch.manual_seed(config.seed)
    model = model_class(config=model_config).to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # (not in the stubs)
    capturable = config.cuda_graphs and device.type == "cuda" and not (config.compile or dist.enabled)  # (graphs.py)
    optimizer = make_adam(list(model.parameters()), lr=config.learning_rate, device=device, capturable=capturable)
    if device.type == "cuda" and config.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=config.decay_per_epoch)
    augment_rng = torch.Generator(device=device).manual_seed(config.seed * 1009 + dist.rank)

    trained = task.wrap(model)  # the module whose forward the loop runs (the model itself by default)
    if not config.resume:  # (a resumed run's weights have it already)
        init_from_data(model, task, config, device, dist)
    if dist.enabled:
        ids = [device] if device.type == "cuda" else None
        _match_grad_strides(model)
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=ids)
    if config.compile:
        trained = cast(torch.nn.Module, torch.compile(trained))
    return Run(
        config, model_config, device, dist, task, model, trained, optimizer, scheduler, augment_rng, run_dir, saved
    )


def init_from_data(model: Pretrained, task: Task, config: TrainConfig, device: torch.device, dist) -> None:
    """The model's data-dependent initialisation (:meth:`Pretrained.init_from_data`), to run before DDP wraps it:
    on rank 0's first batch of epoch 0, which every rank computes alike from the seed (rank 0's augmentation seed
    too), so that all ranks start from the same weights. Nothing for a model that needs none."""
    if getattr(type(model), "init_from_data", Pretrained.init_from_data) is Pretrained.init_from_data:
        return
    assert config.batch_size is not None  # resolved in build()
    generator = torch.Generator(device=device).manual_seed(config.seed * 1009)  # as rank 0's augment_rng
    batches = task.batches(epoch=0, batch_size=config.batch_size, seed=config.seed, rank=0,
                           world_size=dist.world_size, device=device, generator=generator)  # fmt: skip
    first = next(iter(batches), None)
    if first is not None:  # (an epoch without batches trains nothing either)
        model.init_from_data(first.images)


def _match_grad_strides(model: torch.nn.Module) -> None:
    """Give each gradient its parameter's strides where they differ only in size-1 dimensions (the same memory
    layout; e.g. conv1's [out, 1, 9, 9] weight on 1-channel images, whose backward reports channel stride 1), so
    DDP's bucket views match and it neither warns nor copies."""
    for p in model.parameters():
        if p.requires_grad and 1 in p.shape and p.is_contiguous():
            p.register_hook(lambda g, p=p: g.as_strided(p.shape, p.stride()) if g.is_contiguous() else g)


# ----------------------------------------------------------------------------------------------- epoch
def train_step(run: Run, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the (detached) loss and correct count as device tensors. No host sync."""
    if run.config.channels_last:
        batch.images = batch.images.contiguous(memory_format=torch.channels_last)
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.config.precision == "bf16"):
        out = run.task.forward(run.trained, batch)
        with phase("loss"):  # (profiler ranges, no-ops unless a profile is taken: capsnet.training.profiling)
            loss, n_correct = run.task.loss(run.model, out, batch)
    with phase("backward"):
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with phase("optimizer"):
        run.optimizer.step()
    return loss.detach(), n_correct


def stop_requested(run: Run, signals: _StopFlag, asked: bool) -> bool:
    """Whether to stop now: asked for here (`asked`, or a signal) or, under torchrun, on any rank."""
    return dist_utils.any_rank(asked or signals.signum is not None, run.dist, run.device)


def train_epoch(run: Run, state: RunState, log: _Logger, signals: _StopFlag, on_step) -> bool:
    """The rest of epoch `state.epoch` (from batch `state.batch_in_epoch`); True if it stopped early."""
    config, dist = run.config, run.dist
    run.model.train()
    assert config.batch_size is not None  # resolved in build()
    n_batches = run.task.num_batches(batch_size=config.batch_size, world_size=dist.world_size)
    batches = run.task.batches(
        epoch=state.epoch,
        batch_size=config.batch_size,
        seed=config.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        device=run.device,
        generator=run.augment_rng,
        start=state.batch_in_epoch,
    )
    steps = graphs.epoch_steps(run, state.epoch, state.batch_in_epoch, train_step) if config.cuda_graphs else None
    if steps is None:  # eager: one train_step per batch of the task
        steps = ((*train_step(run, batch), batch.images.shape[0]) for batch in batches)
    bar = log.bar(state.epoch, n_batches, state.batch_in_epoch)
    t0, seconds0 = time.perf_counter(), state.sums.seconds  # wall time includes making the batches
    stopped = False
    for loss, n_correct, n in steps:
        state.sums.add(loss, n_correct, n)
        state.step, state.batch_in_epoch = state.step + 1, state.batch_in_epoch + 1
        state.sums.seconds = seconds0 + time.perf_counter() - t0
        log.step(bar, state.step, loss, state.sums)
        state.stop_asked |= bool(on_step is not None and on_step(state.step)) or signals.signum is not None
        # A single process stops at once; torchrun ranks agree every STOP_CHECK_EVERY steps and at the epoch's end.
        if dist.enabled and not (state.step % STOP_CHECK_EVERY == 0 or state.batch_in_epoch == n_batches):
            continue
        if stop_requested(run, signals, state.stop_asked):
            stopped = True
            break
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)  # the epoch's time includes its queued work
    state.sums.seconds = seconds0 + time.perf_counter() - t0
    log.close(bar)
    return stopped


def evaluate_epoch(run: Run, state: RunState) -> dict[str, float]:
    """Close the epoch: reduce the training sums over ranks, step the schedule, score the validation split (the
    test split when there is none) and mark a new best (saved as best/ by the checkpoint that follows)."""
    sums = torch.tensor(state.sums.to_list(), dtype=torch.float64, device=run.device)
    loss_sum, correct, count, seconds = dist_utils.all_sum_tensor(sums, run.dist).tolist()
    seconds /= run.dist.world_size
    lr = float(run.optimizer.param_groups[0]["lr"])  # (a device tensor under --cuda-graphs)
    run.scheduler.step()
    split = "val" if run.task.has_val else "test"
    scores = run.task.evaluate(
        run.model, split=split, batch_size=run.config.eval_batch_size, device=run.device, dist=run.dist
    )
    row = {
        "epoch": state.epoch + 1,
        "train_loss": loss_sum / count,
        "train_acc": correct / count,
        f"{split}_loss": scores["loss"],
        f"{split}_acc": scores["accuracy"],
        "lr": lr,
        "images_per_s": count / max(seconds, 1e-9),
        "seconds": seconds,
    }
    state.history.append(row)
    metric = f"{split}_acc"
    if row[metric] > state.best.get("value", -1.0):
        state.best = {"epoch": state.epoch + 1, "step": state.step, "metric": metric, "value": row[metric]}
    return row


def final_test(run: Run, state: RunState) -> dict[str, Any]:
    """Score the test split once, at the end of the run: best/ (the checkpoint chosen on validation) and the
    final weights (last/); rank 0 writes test.json. Every rank calls it (the scores are summed over ranks)."""
    dist_utils.barrier(run.dist)  # best/ is rank 0's
    kwargs: dict[str, Any] = {"split": "test", "batch_size": run.config.eval_batch_size, "device": run.device,
                              "dist": run.dist}  # fmt: skip
    last = run.task.evaluate(run.model, **kwargs)
    report: dict[str, Any] = {"selected_on": state.best.get("metric"), "epochs": state.epoch}
    best_weights = run.dir / "best" / WEIGHTS_NAME
    if best_weights.is_file():
        best_model = copy.deepcopy(run.model)
        best_model.load_state_dict(load_file(str(best_weights), device=str(run.device)))
        best = run.task.evaluate(best_model, **kwargs)
        del best_model
        report["best"] = {"epoch": state.best.get("epoch"), state.best.get("metric", "value"): state.best.get("value"),
                          **_scores(best)}  # fmt: skip
    report["last"] = {"epoch": state.epoch, **_scores(last)}
    if report["selected_on"] == "test_acc":
        report["note"] = "best/ was chosen on the test set: its test accuracy is a maximum over epochs"
    if run.dist.is_main:
        atomic_write_json(run.dir / TEST_NAME, report)
    return report


def _scores(metrics: dict[str, Any]) -> dict[str, Any]:
    return {"accuracy": metrics["accuracy"], "loss": metrics["loss"], "n": metrics.get("n")}
