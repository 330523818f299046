"""What a running training run shows: the progress bar, epoch lines, TensorBoard, and stop signals."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..logs import LOGGER
from .checkpoint import write_summary
from .config import FitConfig, TrainConfig
from .selection import SELECTED_ON

if TYPE_CHECKING:  # annotations only: the loop imports this module
    from .build import Run
    from .state import EpochSums, RunState

PROGRESS_EVERY_S = 0.5  # the progress bar reads the device's running sums at most this often
# What best/ was chosen on, in words, by the metric name a run records.


def describe_selection(report: dict) -> str:
    """How best/ was chosen, in words: "validation loss (monitor val_loss; the moving average's weights)"."""
    chosen = SELECTED_ON.get(report.get("selected_on") or "", "?")
    monitor, weights = report.get("monitor"), (report.get("best") or {}).get("weights")
    extra = [f"monitor {monitor}"] if monitor and "," in monitor else []
    extra += ["the moving average's weights"] if weights == "ema" else []
    return f"{chosen} ({'; '.join(extra)})" if extra else chosen


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the next check and returns. A SIGINT after that
    (a second Ctrl-C) exits at once with status 130, without waiting for the step, evaluation, compile or kernel
    build in progress: the checkpoint last saved stays as it was (every file of it is written atomically)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        # os.write, not print: the handler may run while the main thread is inside a write to the same stream.
        main = os.environ.get("RANK", "0") == "0"  # under torchrun every rank receives the terminal's Ctrl-C
        if self.signum is not None and signum == signal.SIGINT:
            if main:
                os.write(2, b"\ninterrupted again: exiting now, without saving (the last checkpoint is kept)\n")
            os._exit(130)
        self.signum = signum
        if main and signum == signal.SIGINT:
            os.write(2, b"\ninterrupted: saving a checkpoint at the next step (Ctrl-C again to exit at once)\n")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


class RunLog:
    """tqdm progress on rank 0 (refreshed at most every PROGRESS_EVERY_S, the only in-epoch reads of the device),
    one summary line per epoch, and TensorBoard scalars when available."""

    def __init__(self, run_dir: Path, config: TrainConfig | FitConfig, enabled: bool):
        self.enabled, self.config, self.writer = enabled, config, None
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, loss) for TensorBoard, read at a refresh
        self._last = 0.0
        if enabled and config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional extra
                pass
            else:
                self.writer = SummaryWriter(str(run_dir / "tb"))

    def start(self, run: Run, state: RunState) -> None:
        """Rank 0 writes, resuming, the run's summary.csv so far, and says when best/ is not chosen on validation."""
        if not self.enabled:
            return
        if state.history:
            write_summary(run.dir, state.history)
        note = run.task.selection_note()
        if note:
            LOGGER.warning(note)

    def bar(self, epoch: int, total: int, done: int):
        if not (self.enabled and self.config.progress):
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=total,
            initial=done,
            desc=f"epoch {epoch + 1}/{self.config.epochs}",
            leave=False,
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=PROGRESS_EVERY_S,
            disable=None,  # tqdm's convention: no bar when stderr is not a terminal (no \r lines in a captured log)
        )

    def step(self, bar, step: int, loss: torch.Tensor, sums: EpochSums) -> None:
        if self.writer is not None and step % 10 == 0:
            self._pending.append((step, loss))
        if bar is not None:
            bar.update(1)
        now = time.perf_counter()
        if now - self._last < PROGRESS_EVERY_S:
            return
        self._last = now
        self._flush()
        if bar is not None:
            loss_sum, correct, count, seconds = sums.to_list()
            bar.set_postfix(
                loss=f"{loss_sum / count:.4f}",
                acc=f"{correct / count:.4f}",
                img_s=f"{count / max(seconds, 1e-9):.0f}",
                refresh=False,
            )

    def _flush(self) -> None:
        """Write the pending step losses to TensorBoard (one device read for all of them)."""
        if self._pending and self.writer is not None:
            values = torch.stack([loss for _, loss in self._pending]).tolist()
            for (step, _), value in zip(self._pending, values, strict=True):
                self.writer.add_scalar("train/step_loss", value, step)
        self._pending = []

    def close(self, bar) -> None:
        self._flush()
        if bar is not None:
            bar.close()

    def epoch(self, row: dict[str, float]) -> None:
        if not self.enabled:
            return
        split = "val" if "val_acc" in row else "test" if "test_acc" in row else None
        scored = f"  {split} loss {row[f'{split}_loss']:.4f} acc {row[f'{split}_acc']:.4f}" if split else ""
        if split and f"ema_{split}_acc" in row:  # --ema: its moving average's figures
            scored += f"  (ema loss {row[f'ema_{split}_loss']:.4f} acc {row[f'ema_{split}_acc']:.4f})"
        LOGGER.info(
            f"epoch {int(row['epoch'])}/{self.config.epochs}  train loss {row['train_loss']:.4f}  "
            f"train acc {row['train_acc']:.4f}{scored}  lr {row['lr']:.2e}  "
            f"{row['images_per_s']:.0f} img/s  {row['seconds']:.1f}s"
        )
        if self.writer is not None:
            held = (
                tuple(k for k in (f"{split}_loss", f"{split}_acc", f"ema_{split}_loss", f"ema_{split}_acc") if k in row)
                if split
                else ()
            )
            for key in ("train_loss", "train_acc", *held, "lr", "images_per_s"):
                self.writer.add_scalar(f"epoch/{key}", row[key], int(row["epoch"]))
            self.writer.flush()

    def tested(self, report: dict) -> None:
        """The test split's figures of best/ and last/, once, at the end of the run."""
        if not self.enabled:
            return
        parts = [
            f"{name}/ (epoch {report[name]['epoch']}) {report[name]['accuracy']:.4f}"
            for name in ("best", "last")
            if name in report
        ]
        LOGGER.info(f"test accuracy: {', '.join(parts)}; best/ chosen on {describe_selection(report)}")
        if self.writer is not None:
            for name in ("best", "last"):
                if name in report:
                    self.writer.add_scalar(f"test/{name}_acc", report[name]["accuracy"], report[name]["epoch"])
            self.writer.flush()

    def finish(self, interrupted: bool, signum: int | None, epoch: int, batch: int, *, kept_epoch=False) -> None:
        """The closing line of a stopped run. `kept_epoch`: stopped mid-epoch in a task that resumes only at epoch
        boundaries, so the checkpoint of the last finished epoch was kept."""
        if self.writer is not None:
            self.writer.close()
        if self.enabled and interrupted:
            why = signal.Signals(signum).name if signum else "stop requested"
            if not kept_epoch:
                again = "resume=True" if isinstance(self.config, FitConfig) else "--resume"
                where = f"checkpoint saved at epoch {epoch + 1}, batch {batch}; continue with {again}"
            elif epoch == 0:
                where = f"stopped in epoch 1 at batch {batch}, before any checkpoint (the data is an iterable)"
            else:
                where = (
                    f"stopped in epoch {epoch + 1} at batch {batch}; the data is an iterable, so the checkpoint "
                    f"of epoch {epoch} is kept and a resumed run starts epoch {epoch + 1} again"
                )
            LOGGER.warning(f"{why}: {where}")
