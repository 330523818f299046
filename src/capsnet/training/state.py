"""A run's state: an epoch's running sums, where the run is, and its restore from state.pt on `--resume`.

The checkpoint set that saves it at the end of each epoch and at a stop: capsnet.training.checkpoint.save_checkpoint.
(Which run is resumed, and whether its data and settings are its own: capsnet.training.runfolder.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointError
from .checkpoint import (
    STATE_NAME,
    best_model_of,
    model_name,
    restore_views,
    set_rng_states,
)

if TYPE_CHECKING:  # annotations only: the run's builder imports this module
    from .build import Run


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

    @classmethod
    def restored(cls, saved: dict[str, Any], *, is_main: bool, device: torch.device) -> EpochSums:
        """This rank's share of a state.pt's "running": it holds the sums over every rank, which rank 0 restores
        while the others start from zero; a state.pt without "running_ranks" holds rank 0's sums alone, which every
        rank restores."""
        own = is_main or "running_ranks" not in saved
        return cls.from_list(list(saved["running"]) if own else [0.0] * 4, device)

    def add(self, loss: torch.Tensor, n_correct: torch.Tensor | float, n: int) -> None:
        self.loss += loss.detach().double() * n  # (float64: a long epoch's sum keeps its precision)
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
    best: dict[str, Any] = field(default_factory=dict)  # {"epoch", "step", "metric", "value"} of best/
    history: list[dict[str, float]] = field(default_factory=list)
    stop_asked: bool = False  # on_step or a signal asked to stop (under torchrun, not yet agreed on by all ranks)

    def next_epoch(self) -> None:
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.sums = EpochSums.zeros(self.sums.loss.device)


def restore(run: Run) -> RunState:
    """The RunState, weights, optimizer, schedule and random streams of the state.pt being resumed from; its views
    (last/, best/, summary.csv) rewritten from it, in case a kill left them a save behind; then the loaded state is
    dropped (its copies of the weights and Adam moments would otherwise stay in memory for the whole run)."""
    saved, config = run.state_dict, run.config
    assert saved is not None  # restore() is called only when resuming
    check_processes(saved, world_size=run.dist.world_size, where=run.dir / STATE_NAME)
    try:
        run.model.load_state_dict(saved["model"])
    except RuntimeError as e:
        first = " ".join(str(e).strip().splitlines()[:2])
        run_model = f"a {saved['model_type']} run" if saved.get("model_type") else "the run's"
        raise CheckpointError(
            f"{run.dir / STATE_NAME}: its weights ({run_model}) do not fit the "
            f"{model_name(run.model)} being resumed ({first})"
        ) from None
    run.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    if run.scheduler.gamma != config.decay_per_epoch:  # resumed with other --epochs/--lr-decay/--lr-end:
        run.scheduler.gamma = config.decay_per_epoch  # epoch e runs at lr × decay^e under the new flags
        for group, base_lr in zip(run.optimizer.param_groups, run.scheduler.base_lrs, strict=True):
            group["lr"] = base_lr * run.scheduler.gamma ** saved["epoch"]
    set_rng_states(saved["rng"], run.device, run.augment_rng, run.dist)
    if run.ema is not None:
        if "ema" not in saved:  # (--ema is a setting of the run: it may not change on resume)
            raise CheckpointError(f"{run.dir / STATE_NAME}: holds no moving average of the weights for --ema")
        run.ema.load_state_dict(saved["ema"])
    best = saved["best"]
    restore_views(
        run.dir, {**saved, "best": best}, run.model, is_main=run.dist.is_main, best_model=best_model_of(run, best)
    )
    state = RunState(
        EpochSums.restored(saved, is_main=run.dist.is_main, device=run.device),
        saved["epoch"],
        saved["batch_in_epoch"],
        saved["step"],
        best,
        list(saved["history"]),
    )
    run.state_dict = None
    return state


def check_processes(saved: dict[str, Any], *, world_size: int, where: Path) -> None:
    """A state.pt written in the middle of an epoch resumes only under as many processes as wrote it: its
    `batch_in_epoch` counts each rank's batches of that epoch's split of the images over those processes."""
    ranks = saved.get("running_ranks")
    if saved.get("batch_in_epoch", 0) and ranks is not None and ranks != world_size:
        raise CheckpointError(
            f"{where}: stopped in the middle of epoch {saved['epoch'] + 1} under {ranks} process(es); resume it "
            f"with {ranks} (torchrun --nproc-per-node {ranks}), not {world_size}"
        )
