"""`capsnet train`: the paper's MNIST recipe (§4), resumable, kill-safe, and scalable with torchrun.

Recipe (defaults): Adam, lr 1e-3 with exponential decay per epoch, stretched over the run so that the last epoch
trains at lr × lr_end; random shifts of up to 2 px (§5); margin loss (Eq. 4) + 0.0005 × the summed squared
reconstruction error, the decoder masked by the true label (§4.1).

What is trained on comes from a :class:`capsnet.training.tasks.Task` (the MNIST recipe by default; MultiMNIST and
expanded MNIST in :mod:`capsnet.reproduce`); `model` chooses CapsNet or the paper's baseline CNN.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..config import from_dict, to_dict
from ..errors import ConfigError
from ..fileio import atomic_write_json
from ..models.baseline import BaselineConfig
from ..models.capsnet import CapsNetConfig
from ..models.registry import MODELS
from . import distributed as dist_utils
from .checkpoint import STATE_NAME, load_state, save_state, write_summary
from .tasks import ClassificationTask, Task


@dataclass
class TrainConfig:
    """How to train; the model's own options live in :class:`capsnet.CapsNetConfig`."""

    dataset: str = field(default="mnist-sample", metadata={"help": "data set name or MNIST-format folder"})
    data_dir: str | None = field(default=None, metadata={"help": "folder with the four MNIST-format IDX files"})
    train_subset: int | None = field(default=None, metadata={"help": "use only the first N training images"})
    test_subset: int | None = field(default=None, metadata={"help": "evaluate on the first N test images only"})
    shift: int = field(default=2, metadata={"help": "random translation of up to N pixels (paper: 2)"})
    epochs: int = field(default=10, metadata={"help": "number of epochs"})
    batch_size: int = field(default=16, metadata={"help": "images per step, per process"})
    lr: float | None = field(
        default=None, metadata={"help": "Adam learning rate; if unset, the model's (CapsNet 1e-3, baseline CNN 1e-4)"}
    )
    lr_decay: float | None = field(
        default=None,
        metadata={"help": "learning rate factor applied after every epoch; if unset, lr_end^(1/(epochs-1))"},
    )
    lr_end: float = field(
        default=0.25, metadata={"help": "without --lr-decay, the last epoch trains at lr x lr_end (3 epochs: x0.5)"}
    )
    eval_batch_size: int = field(default=250, metadata={"help": "images per evaluation batch"})
    seed: int = field(default=0, metadata={"help": "seed for initialisation, shuffling and augmentation"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:K"})
    precision: Literal["fp32", "bf16"] = field(default="fp32", metadata={"help": "bf16 runs under autocast"})
    channels_last: bool = field(default=False, metadata={"help": "channels-last memory format for the convolutions"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    out: str = field(default="runs/capsnet", metadata={"help": "run folder for checkpoints and metrics"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out from its last checkpoint"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard scalars when installed"})
    model: Literal["capsnet", "baseline"] = field(
        default="capsnet", metadata={"help": "capsnet, or the paper's baseline CNN (capsnet.baseline)"}
    )

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("train_subset", "test_subset"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shift < 0:
            raise ConfigError(f"shift must be >= 0, got {self.shift}")
        lr_ok = self.lr is None or self.lr > 0
        if not (lr_ok and 0 < self.lr_end <= 1 and (self.lr_decay is None or 0 < self.lr_decay <= 1)):
            raise ConfigError("need lr > 0, 0 < lr_decay <= 1 and 0 < lr_end <= 1")

    @property
    def learning_rate(self) -> float:
        """The Adam learning rate: `lr` if given, else the model's own default (`default_lr` of its class)."""
        return self.lr if self.lr is not None else MODELS[self.model].default_lr

    @property
    def decay_per_epoch(self) -> float:
        """The exponential decay's factor per epoch: `lr_decay` if given, else the factor that brings the last
        epoch's learning rate to lr × lr_end, so the schedule stretches with `epochs` (1 epoch: no decay)."""
        if self.lr_decay is not None:
            return self.lr_decay
        return self.lr_end ** (1.0 / (self.epochs - 1)) if self.epochs > 1 else 1.0


@dataclass
class TrainResult:
    run_dir: Path
    epochs_done: int
    best_test_acc: float
    history: list[dict[str, float]]
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped the run, if one did
    is_main: bool = True  # rank 0 (or a single process): the one that reports


# Model options that come from the data set rather than from flags.
DATA_FIELDS = ("in_channels", "image_size", "n_classes")


def make_adam(params: list[torch.nn.Parameter], *, lr: float, device: torch.device) -> torch.optim.Adam:
    """Adam, with PyTorch's fused kernel where it exists (CUDA; CPU since torch 2.4): the same update in one pass
    over memory instead of several."""
    if device.type in ("cpu", "cuda"):
        try:
            return torch.optim.Adam(params, lr=lr, fused=True)
        except RuntimeError:  # an older torch without the fused kernel for this device
            pass
    return torch.optim.Adam(params, lr=lr)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:K") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available")
    return device


class _StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next step and returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> _StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def train(
    config: TrainConfig,
    model_config: CapsNetConfig | BaselineConfig | None = None,
    *,
    on_step: Callable[[int], bool] | None = None,
    task: Task | None = None,
) -> TrainResult:
    """Train a CapsNet (or the baseline CNN) as `config` says; returns when done or when a stop was asked for.

    `on_step(global_step)` is called after every optimizer step; returning True stops training with a
    checkpoint, as SIGINT and SIGTERM do. `task` supplies the batches, loss and test metrics; by default the
    MNIST classification recipe on `config.dataset` (its dataset, subset and shift fields).
    """
    device = resolve_device(config.device)
    dist = dist_utils.setup(device)
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
    try:
        return _train(config, model_config, device, dist, on_step, task)
    finally:
        dist_utils.teardown(dist)


def _train(config, model_config, device, dist, on_step, task) -> TrainResult:
    run_dir = Path(config.out)
    has_state = (run_dir / STATE_NAME).is_file()
    if has_state and not config.resume:
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or choose another --out")
    if config.resume and not has_state:
        raise ConfigError(f"--resume: {run_dir} holds no {STATE_NAME} to continue from")

    task = task if task is not None else ClassificationTask.from_config(config)
    model_class = MODELS[config.model]
    state = load_state(run_dir, map_location=device) if config.resume else None
    if state is not None:  # the run's model is the one saved with it
        model_config = from_dict(model_class.config_class, state["model_config"], what=f"{run_dir}/{STATE_NAME}")
    if model_config is not None and not isinstance(model_config, model_class.config_class):
        raise ConfigError(f"model {config.model!r} takes a {model_class.config_class.__name__}")
    model_config = dataclasses.replace(model_config or model_class.config_class(), **task.model_fields())

    torch.manual_seed(config.seed)
    model = model_class(config=model_config).to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_adam(list(model.parameters()), lr=config.learning_rate, device=device)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=config.decay_per_epoch)
    augment_rng = torch.Generator(device=device).manual_seed(config.seed * 1009 + dist.rank)
    epoch, batch_in_epoch, step, best_acc = 0, 0, 0, -1.0
    history: list[dict[str, float]] = []
    running = [0.0, 0.0, 0.0, 0.0]  # loss sum, correct, count, seconds within the current epoch
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scheduler.gamma != config.decay_per_epoch:  # resumed with other --epochs/--lr-decay/--lr-end:
            scheduler.gamma = config.decay_per_epoch  # epoch e runs at lr × decay^e under the new flags
            for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
                group["lr"] = base_lr * scheduler.gamma ** state["epoch"]
        epoch, batch_in_epoch, step = state["epoch"], state["batch_in_epoch"], state["step"]
        best_acc, history, running = state["best_test_acc"], list(state["history"]), list(state["running"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        saved = state["rng"]["augment"]
        if len(saved) == dist.world_size:  # same number of processes: continue each stream exactly
            augment_rng.set_state(saved[dist.rank].cpu())

    trained = task.wrap(model)  # the module whose forward runs each step (the model itself by default)
    if dist.enabled:
        ids = [device] if device.type == "cuda" else None
        trained = torch.nn.parallel.DistributedDataParallel(trained, device_ids=ids)
    if config.compile:
        trained = torch.compile(trained)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")

    log = _Logger(run_dir, config, dist.is_main)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        meta = {"train": to_dict(config), "model": to_dict(model_config), "task": task.name}
        atomic_write_json(run_dir / "config.json", meta)
        if history:
            write_summary(run_dir, history)

    def checkpoint(*, epoch_done: bool) -> None:
        rngs = [augment_rng.get_state()]
        if dist.enabled:  # every rank's augmentation stream, gathered to rank 0
            rngs = [torch.empty_like(rngs[0]) for _ in range(dist.world_size)]
            torch.distributed.all_gather_object(rngs, augment_rng.get_state())
        if not dist.is_main:
            return
        model.save_pretrained(run_dir / "last")
        save_state(run_dir, {
            "model": model.state_dict(), "model_config": to_dict(model_config),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "epoch": epoch + (1 if epoch_done else 0), "batch_in_epoch": 0 if epoch_done else batch_in_epoch,
            "step": step, "best_test_acc": best_acc, "history": history,
            "running": [0.0] * 4 if epoch_done else running,
            "rng": {"torch": torch.get_rng_state(), "augment": [r.cpu() for r in rngs]},
        })  # fmt: skip
        write_summary(run_dir, history)

    n_batches = task.num_batches(batch_size=config.batch_size, world_size=dist.world_size)
    interrupted = False
    with _StopFlag() as stop:
        while epoch < config.epochs and not interrupted:
            model.train()
            batches = task.batches(
                epoch=epoch, batch_size=config.batch_size, seed=config.seed, rank=dist.rank,
                world_size=dist.world_size, device=device, generator=augment_rng, start=batch_in_epoch,
            )  # fmt: skip
            bar = log.bar(epoch, n_batches, batch_in_epoch)
            t0 = time.perf_counter()  # step time includes making the batch (augmentation, MultiMNIST rendering)
            for batch in batches:
                if config.channels_last:
                    batch.images = batch.images.contiguous(memory_format=torch.channels_last)
                with autocast:
                    out = task.forward(trained, batch)
                    loss, n_correct = task.loss(model, out, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                batch_in_epoch += 1
                n = batch.images.shape[0]
                running[0] += loss.item() * n
                running[1] += n_correct
                running[2] += n
                running[3] += time.perf_counter() - t0
                log.step(bar, step, loss.item(), running)
                t0 = time.perf_counter()
                asked = (on_step is not None and on_step(step)) or stop.signum is not None
                if dist_utils.any_rank(asked, dist, device):
                    interrupted = True
                    break
            log.close(bar)
            if interrupted:
                checkpoint(epoch_done=False)
                break
            loss_sum, correct, count, seconds = dist_utils.all_sum(running, dist, device)
            seconds /= dist.world_size
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step()
            test = task.evaluate(model, batch_size=config.eval_batch_size, device=device, dist=dist)
            row = {
                "epoch": epoch + 1, "train_loss": loss_sum / count, "train_acc": correct / count,
                "test_loss": test["loss"], "test_acc": test["accuracy"], "lr": lr,
                "images_per_s": count / max(seconds, 1e-9), "seconds": seconds,
            }  # fmt: skip
            history.append(row)
            improved = row["test_acc"] > best_acc
            best_acc = max(best_acc, row["test_acc"])
            if dist.is_main and improved:
                model.save_pretrained(run_dir / "best")
            checkpoint(epoch_done=True)
            log.epoch(row)
            epoch, batch_in_epoch, running = epoch + 1, 0, [0.0, 0.0, 0.0, 0.0]
    log.finish(interrupted, stop.signum, epoch, batch_in_epoch)
    dist_utils.barrier(dist)
    return TrainResult(run_dir, epoch, best_acc, history, interrupted, stop.signum, dist.is_main)


class _Logger:
    """tqdm progress on rank 0, one summary line per epoch, and TensorBoard scalars when available."""

    def __init__(self, run_dir: Path, config: TrainConfig, enabled: bool):
        self.enabled, self.config, self.writer = enabled, config, None
        if enabled and config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra
                pass
            else:
                self.writer = SummaryWriter(str(run_dir / "tb"))

    def bar(self, epoch: int, total: int, done: int):
        if not (self.enabled and self.config.progress):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=done, desc=f"epoch {epoch + 1}/{self.config.epochs}", leave=False,
                    dynamic_ncols=True, file=sys.stderr)  # fmt: skip

    def step(self, bar, step: int, loss: float, running: list[float]) -> None:
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{running[0] / running[2]:.4f}", acc=f"{running[1] / running[2]:.4f}",
                            img_s=f"{running[2] / max(running[3], 1e-9):.0f}")  # fmt: skip
        if self.writer is not None and step % 10 == 0:
            self.writer.add_scalar("train/step_loss", loss, step)

    def close(self, bar) -> None:
        if bar is not None:
            bar.close()

    def epoch(self, row: dict[str, float]) -> None:
        if not self.enabled:
            return
        print(
            f"epoch {int(row['epoch'])}/{self.config.epochs}  train loss {row['train_loss']:.4f}  "
            f"train acc {row['train_acc']:.4f}  test acc {row['test_acc']:.4f}  lr {row['lr']:.2e}  "
            f"{row['images_per_s']:.0f} img/s  {row['seconds']:.1f}s",
            flush=True,
        )
        if self.writer is not None:
            for key in ("train_loss", "train_acc", "test_loss", "test_acc", "lr", "images_per_s"):
                self.writer.add_scalar(f"epoch/{key}", row[key], int(row["epoch"]))
            self.writer.flush()

    def finish(self, interrupted: bool, signum: int | None, epoch: int, batch: int) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.enabled and interrupted:
            why = signal.Signals(signum).name if signum else "stop requested"
            print(f"{why}: checkpoint saved at epoch {epoch + 1}, batch {batch}; continue with --resume",
                  file=sys.stderr, flush=True)  # fmt: skip
