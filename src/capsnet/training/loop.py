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

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ..config import from_dict, to_dict
from ..errors import ConfigError
from ..models.pretrained import Pretrained
from ..models.registry import MODELS
from . import distributed as dist_utils
from .checkpoint import STATE_NAME, get_rng_states, load_state, save_state, set_rng_states, write_summary
from .config import DATA_FIELDS, TrainConfig, TrainResult
from .hardware import default_batch_size, precision_note, rank_device, resolve_device
from .memory import check_memory
from .progress import _Logger, _StopFlag
from .tasks import Batch, ClassificationTask, Task

__all__ = ["DATA_FIELDS", "TrainConfig", "TrainResult", "make_adam", "resolve_device", "train"]

STOP_CHECK_EVERY = 16  # steps between the torchrun ranks' agreement on a stop (one all-reduce + one host sync)


def make_adam(params: list[torch.nn.Parameter], *, lr: float, device: torch.device) -> torch.optim.Adam:
    """Adam, with PyTorch's fused kernel where it exists (CUDA; CPU since torch 2.4): the same update in one pass
    over memory instead of several."""
    if device.type in ("cpu", "cuda"):
        try:
            return torch.optim.Adam(params, lr=lr, fused=True)
        except RuntimeError:  # an older torch without the fused kernel for this device
            pass
    return torch.optim.Adam(params, lr=lr)


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
    log.finish(stop, signals.signum, state.epoch, state.batch_in_epoch)
    dist_utils.barrier(dist)
    return TrainResult(run.dir, state.epoch, state.best_acc, state.history, stop, signals.signum, dist.is_main)


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
    state_dict: dict | None = None  # the state.pt being resumed from


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

    task = task if task is not None else ClassificationTask.from_config(config)
    model_class = MODELS[config.model]
    saved = load_state(run_dir, map_location=device) if config.resume else None
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
    optimizer = make_adam(list(model.parameters()), lr=config.learning_rate, device=device)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=config.decay_per_epoch)
    augment_rng = torch.Generator(device=device).manual_seed(config.seed * 1009 + dist.rank)

    trained = task.wrap(model)  # the module whose forward the loop runs (the model itself by default)
    if dist.enabled:
        ids = [device] if device.type == "cuda" else None
        _match_grad_strides(model)
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=ids)
    if config.compile:
        trained = cast(torch.nn.Module, torch.compile(trained))
    return Run(
        config, model_config, device, dist, task, model, trained, optimizer, scheduler, augment_rng, run_dir, saved
    )


def _match_grad_strides(model: torch.nn.Module) -> None:
    """Give each gradient its parameter's strides where they differ only in size-1 dimensions (the same memory
    layout; e.g. conv1's [out, 1, 9, 9] weight on 1-channel images, whose backward reports channel stride 1), so
    DDP's bucket views match and it neither warns nor copies."""
    for p in model.parameters():
        if p.requires_grad and 1 in p.shape and p.is_contiguous():
            p.register_hook(lambda g, p=p: g.as_strided(p.shape, p.stride()) if g.is_contiguous() else g)


# ----------------------------------------------------------------------------------------------- state
@dataclass
class EpochSums:
    """Running sums of the current epoch. loss (Σ loss·n) and correct stay float64 tensors on the device, added to
    without a host sync; count and seconds are host numbers."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: int = 0
    seconds: float = 0.0

    @classmethod
    def zeros(cls, device: torch.device) -> EpochSums:
        return cls.from_list([0.0, 0.0, 0, 0.0], device)

    @classmethod
    def from_list(cls, values: list[float], device: torch.device) -> EpochSums:
        """From a checkpoint's [loss sum, correct, count, seconds]."""
        loss, correct, count, seconds = values
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        return cls(torch.tensor(loss, **f64), torch.tensor(correct, **f64), int(count), float(seconds))

    def add(self, loss: torch.Tensor, n_correct: torch.Tensor | float, n: int) -> None:
        self.loss += loss.detach().double() * n  # (the arithmetic of the former host-side float sums)
        self.correct += n_correct
        self.count += n

    def to_list(self) -> list[float]:
        """[loss sum, correct, count, seconds]: reads the device (one sync)."""
        loss, correct = torch.stack([self.loss, self.correct]).tolist()
        return [loss, correct, float(self.count), self.seconds]


@dataclass
class RunState:
    """Where the run is: what a checkpoint saves and a resume restores."""

    sums: EpochSums
    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    best_acc: float = -1.0
    history: list[dict[str, float]] = field(default_factory=list)
    stop_asked: bool = False  # on_step or a signal asked to stop (under torchrun, not yet agreed on by all ranks)

    def next_epoch(self) -> None:
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.sums = EpochSums.zeros(self.sums.loss.device)


def restore(run: Run) -> RunState:
    """The RunState, weights, optimizer, schedule and random streams of the state.pt being resumed from."""
    saved, config = run.state_dict, run.config
    assert saved is not None  # restore() is called only when resuming
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    if run.scheduler.gamma != config.decay_per_epoch:  # resumed with other --epochs/--lr-decay/--lr-end:
        run.scheduler.gamma = config.decay_per_epoch  # epoch e runs at lr × decay^e under the new flags
        for group, base_lr in zip(run.optimizer.param_groups, run.scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * run.scheduler.gamma ** saved["epoch"]
    set_rng_states(saved["rng"], run.device, run.augment_rng, run.dist)
    return RunState(
        EpochSums.from_list(list(saved["running"]), run.device),
        saved["epoch"],
        saved["batch_in_epoch"],
        saved["step"],
        saved["best_test_acc"],
        list(saved["history"]),
    )


def save_checkpoint(run: Run, state: RunState, *, epoch_done: bool) -> None:
    """last/ and state.pt (atomically), and summary.csv; on rank 0, with every rank's augmentation stream."""
    rng = get_rng_states(run.device, run.augment_rng, run.dist)  # a collective under torchrun: every rank calls it
    running = [0.0] * 4 if epoch_done else state.sums.to_list()
    if not run.dist.is_main:
        return
    run.model.save_pretrained(run.dir / "last")
    save_state(
        run.dir,
        {
            "model": run.model.state_dict(),
            "model_config": to_dict(run.model_config),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "epoch": state.epoch + (1 if epoch_done else 0),
            "batch_in_epoch": 0 if epoch_done else state.batch_in_epoch,
            "step": state.step,
            "best_test_acc": state.best_acc,
            "history": state.history,
            "running": running,
            "rng": rng,
        },
    )
    write_summary(run.dir, state.history)


# ----------------------------------------------------------------------------------------------- epoch
def train_step(run: Run, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the (detached) loss and correct count as device tensors. No host sync."""
    if run.config.channels_last:
        batch.images = batch.images.contiguous(memory_format=torch.channels_last)
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.config.precision == "bf16"):
        out = run.task.forward(run.trained, batch)
        loss, n_correct = run.task.loss(run.model, out, batch)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
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
    bar = log.bar(state.epoch, n_batches, state.batch_in_epoch)
    t0, seconds0 = time.perf_counter(), state.sums.seconds  # wall time includes making the batches
    stopped = False
    for batch in batches:
        loss, n_correct = train_step(run, batch)
        state.sums.add(loss, n_correct, batch.images.shape[0])
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
    """Close the epoch: reduce the training sums over ranks, step the schedule, test, keep the best model."""
    sums = torch.tensor(state.sums.to_list(), dtype=torch.float64, device=run.device)
    loss_sum, correct, count, seconds = dist_utils.all_sum_tensor(sums, run.dist).tolist()
    seconds /= run.dist.world_size
    lr = run.optimizer.param_groups[0]["lr"]
    run.scheduler.step()
    test = run.task.evaluate(run.model, batch_size=run.config.eval_batch_size, device=run.device, dist=run.dist)
    row = {
        "epoch": state.epoch + 1,
        "train_loss": loss_sum / count,
        "train_acc": correct / count,
        "test_loss": test["loss"],
        "test_acc": test["accuracy"],
        "lr": lr,
        "images_per_s": count / max(seconds, 1e-9),
        "seconds": seconds,
    }
    state.history.append(row)
    if row["test_acc"] > state.best_acc and run.dist.is_main:
        run.model.save_pretrained(run.dir / "best")
    state.best_acc = max(state.best_acc, row["test_acc"])
    return row
