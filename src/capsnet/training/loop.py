"""The training loop: epochs of steps, each epoch closed by validation, its checkpoint and its log line; the test once.

Recipe (defaults): Adam, lr 1e-3 with exponential decay per epoch, stretched over the run so that the last epoch
trains at lr × lr_end; random shifts of up to 2 px (§5); margin loss (Eq. 4) + 0.0005 × the summed squared
reconstruction error, the decoder masked by the true label (§4.1).

What is trained on comes from a capsnet.training.tasks.Task (the MNIST recipe by default; MultiMNIST and expanded
MNIST in capsnet.experiments); `model` chooses the network from the model registry. The same loop (`run_loop`) trains
what `capsnet.fit` is given: a model instance on a Dataset or DataLoader (capsnet.training.loader.LoaderTask). The
ways in (`train`, `resume`, `fit`): capsnet.training.api.

The training step never waits for the device: the loss, the correct count and their sums stay device tensors,
read once per epoch and, for the progress bar, at most twice a second. Under torchrun, whether any rank was asked
to stop (SIGINT, SIGTERM, `on_step`) is agreed on every STOP_CHECK_EVERY steps and at the end of each epoch (one
small all-reduce), so a stop takes effect within STOP_CHECK_EVERY steps; a single process stops at the next step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from ..fileio import atomic_write_json
from ..logs import LOGGER
from ..models.pretrained import WEIGHTS_NAME
from . import distributed as dist_utils
from . import graphs
from .build import Run
from .callbacks import RunLog, StopFlag
from .checkpoint import TEST_NAME, load_weights, remove_strays, save_checkpoint
from .config import TrainConfig, TrainResult
from .phases import phase
from .record import write_record
from .runfolder import resumed_line
from .selection import choose_best
from .state import EpochSums, RunState, restore
from .stuck import epoch_stuck_line, memorising_line
from .tasks import Batch

STOP_CHECK_EVERY = 16  # steps between the torchrun ranks' agreement on a stop (one all-reduce + one host sync)


# ----------------------------------------------------------------------------------------------- the run
def run_loop(run: Run, on_step: Callable[[int], bool] | None) -> TrainResult:
    """Train `run` (restored from its state.pt when resuming) to its last epoch or a stop; the test split once."""
    dist = run.dist
    if dist.is_main:
        remove_strays(run.dir)  # what a kill of an earlier attempt left
    resuming = run.state_dict is not None
    state = restore(run) if resuming else RunState(sums=EpochSums.zeros(run.device))
    if resuming and dist.is_main:
        assert run.config.batch_size is not None
        n_batches = run.task.num_batches(batch_size=run.config.batch_size, world_size=dist.world_size)
        LOGGER.info(resumed_line(state.epoch, state.batch_in_epoch, n_batches, run.config.epochs))
    if dist.is_main:
        write_record(run.dir, run.config, run.model_config, run.task)
    log = RunLog(run.dir, run.config, dist.is_main)
    log.start(run, state)
    stop = False
    with StopFlag() as signals:
        while state.epoch < run.config.epochs and not stop and not reached(run, state):
            stop = train_epoch(run, state, log, signals, on_step)
            if stop:  # stopped mid-epoch: save where we are (or keep the last epoch's checkpoint, see Task)
                if run.task.resumes_mid_epoch:
                    save_checkpoint(run, state, epoch_done=False)
                break
            row = close_epoch(run, state)
            save_checkpoint(run, state, epoch_done=True)
            log.epoch(row)
            state.next_epoch()
            more = state.epoch < run.config.epochs
            stop = more and stop_requested(run, signals, state.stop_asked)  # asked for during the evaluation
    test = None
    if not stop and run.task.has_test:  # finished (or resumed after its last epoch): the test split, once
        test = final_test(run, state)
        log.tested(test)
    mid_epoch = stop and state.batch_in_epoch > 0
    log.finish(
        stop, signals.signum, state.epoch, state.batch_in_epoch, kept_epoch=mid_epoch and not run.task.resumes_mid_epoch
    )
    dist_utils.barrier(dist)
    return TrainResult(run.dir, state.epoch, state.history, dict(state.best), test, stop, signals.signum, dist.is_main)


# ----------------------------------------------------------------------------------------------- epoch
def train_step(run: Run, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the (detached) loss and correct count as device tensors. No host sync."""
    if run.config.channels_last:
        batch.images = batch.images.contiguous(memory_format=torch.channels_last)
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.config.precision == "bf16"):
        out = run.task.forward(run.trained, batch)
        with phase("loss"):  # (profiler ranges, no-ops unless a profile is taken: capsnet.training.phases)
            loss, n_correct = run.task.loss(run.model, out, batch)
    with phase("backward"):
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with phase("optimizer"):
        run.optimizer.step()
    return loss.detach(), n_correct


def reached(run: Run, state: RunState) -> bool:
    """Whether the last finished epoch's validation accuracy reached --stop-at-val-acc (then the run ends there, as
    at its last epoch; a resumed run that had reached it trains no further, one stopped mid-epoch finishes that
    epoch first). Every rank reads the same reduced row."""
    threshold = run.config.stop_at_val_acc  # None (not given) and 0 (turned off) never stop
    if not threshold or not state.history or state.batch_in_epoch > 0:
        return False
    if state.history[-1].get("val_acc", -1.0) < threshold:
        return False
    if run.dist.is_main:
        row = state.history[-1]
        LOGGER.info(
            f"validation accuracy {row['val_acc']:.4f} reached --stop-at-val-acc {threshold} at epoch "
            f"{row['epoch']} of {run.config.epochs}: training stops here"
        )
    return True


def stop_requested(run: Run, signals: StopFlag, asked: bool) -> bool:
    """Whether to stop now: asked for here (`asked`, or a signal) or, under torchrun, on any rank."""
    return dist_utils.any_rank(asked or signals.signum is not None, run.dist, run.device)


def has_batch_norm(model: torch.nn.Module) -> bool:
    """Whether `model` normalises by batch statistics: a last training batch of one image is then left out of
    the epoch (as DataLoader's drop_last would), since one value per channel has no variance."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def train_epoch(run: Run, state: RunState, log: RunLog, signals: StopFlag, on_step) -> bool:
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
        single = dist.world_size == 1 and has_batch_norm(run.model)  # (a batch of one has no batch statistics)
        steps = (
            (*train_step(run, batch), batch.images.shape[0])
            for batch in batches
            if not (single and batch.images.shape[0] == 1)
        )
    bar = log.bar(state.epoch, n_batches, state.batch_in_epoch)
    t0, seconds0 = time.perf_counter(), state.sums.seconds  # wall time includes making the batches
    stopped = False
    for loss, n_correct, n in steps:
        state.sums.add(loss, n_correct, n)
        if run.ema is not None:
            run.ema.update(run.model)
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


def close_epoch(run: Run, state: RunState) -> dict[str, float]:
    """Close the epoch: its history row (`evaluate_epoch`), the schedule's step, and a new best (saved as
    best/ by the checkpoint that follows) by the run's monitor (capsnet.training.selection)."""
    row, split, candidates, n_classes = evaluate_epoch(run, state)
    run.scheduler.step()  # the learning rate's decay per epoch
    flag = "--lr" if isinstance(run.config, TrainConfig) else "lr="
    line = epoch_stuck_line(row, n_classes=n_classes, flag=flag)
    if line is not None and run.dist.is_main:
        LOGGER.warning(line)
    line = memorising_line(row, state.history[:-1], flag=flag)  # (the history ends with this epoch's row)
    if line is not None and run.dist.is_main:
        LOGGER.warning(line)
    spec = run.config.monitor if split is not None else "val_loss"  # (no held-out data: the training loss)
    assert spec is not None  # resolved by open_run()
    state.best = choose_best(state.best, candidates, spec=spec, split=split, epoch=state.epoch + 1, step=state.step)
    return row


def evaluate_epoch(run: Run, state: RunState) -> tuple[dict[str, float], str | None, list[tuple[str, dict]], int]:
    """The epoch's history row: the training sums reduced over ranks, and the scores of the validation split (the
    test split when there is none, nothing when there is neither), with --ema its moving average's too. Returns
    (row, the split scored or None, the candidates for best/: (weights "raw" | "ema", scores), the number of class
    lengths the evaluation measured or 0); without a split scored, the one candidate is the raw weights' training
    loss."""
    sums = torch.tensor(state.sums.to_list(), dtype=torch.float64, device=run.device)
    loss_sum, correct, count, seconds = dist_utils.all_sum_tensor(sums, run.dist).tolist()
    seconds /= run.dist.world_size
    lr = float(run.optimizer.param_groups[0]["lr"])  # (a device tensor under --cuda-graphs)
    split = "val" if run.task.has_val else "test" if run.task.has_test else None
    row = {"epoch": state.epoch + 1, "train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1)}
    candidates: list[tuple[str, dict[str, float]]] = [("raw", {"loss": row["train_loss"]})]
    row_classes = 0  # the class lengths' number, where the model's outputs have them
    if split is not None:
        models = [("raw", run.model)] + ([("ema", run.ema.model)] if run.ema is not None else [])
        candidates = []
        for weights, model in models:
            scores = run.task.evaluate(
                model, split=split, batch_size=run.config.eval_batch_size, device=run.device, dist=run.dist
            )
            prefix = "" if weights == "raw" else "ema_"
            row.update({f"{prefix}{split}_loss": scores["loss"], f"{prefix}{split}_acc": scores["accuracy"]})
            if weights == "raw" and "shortest" in scores:
                row.update({"shortest_length": scores["shortest"], "longest_length": scores["longest"]})
                row_classes = int(scores["classes"])
            candidates.append((weights, {"accuracy": scores["accuracy"], "loss": scores["loss"]}))
    row.update({"lr": lr, "images_per_s": count / max(seconds, 1e-9), "seconds": seconds})
    state.history.append(row)
    return row, split, candidates, row_classes


def final_test(run: Run, state: RunState) -> dict[str, Any]:
    """Score the test split once, at the end of the run: best/ (the checkpoint chosen on validation) and the
    final weights (last/); rank 0 writes test.json. Every rank calls it (the scores are summed over ranks)."""
    dist_utils.barrier(run.dist)  # best/ is rank 0's
    kwargs: dict[str, Any] = {
        "split": "test",
        "batch_size": run.config.eval_batch_size,
        "device": run.device,
        "dist": run.dist,
    }
    last = run.task.evaluate(run.model, **kwargs)
    report: dict[str, Any] = {
        "selected_on": state.best.get("metric"),
        "monitor": run.config.monitor,
        "epochs": state.epoch,
    }
    best_weights = run.dir / "best" / WEIGHTS_NAME
    if best_weights.is_file():
        best_model = copy.deepcopy(run.model)
        load_weights(best_model, best_weights, device=run.device)
        best = run.task.evaluate(best_model, **kwargs)
        del best_model
        report["best"] = {
            "epoch": state.best.get("epoch"),
            "weights": state.best.get("weights", "raw"),
            **_selection_scores(state),
            state.best.get("metric", "value"): state.best.get("value"),
            **_scores(best),
        }
    report["last"] = {"epoch": state.epoch, **_scores(last)}
    if str(report["selected_on"]).startswith("test_"):
        report["note"] = "best/ was chosen on the test set: its test accuracy is a maximum over epochs"
    elif report["selected_on"] == "train_loss":
        report["note"] = "best/ was chosen on the training loss (no validation data)"
    if run.dist.is_main:
        atomic_write_json(run.dir / TEST_NAME, report)
    return report


def _scores(metrics: dict[str, Any]) -> dict[str, Any]:
    return {"accuracy": metrics["accuracy"], "loss": metrics["loss"], "n": metrics.get("n")}


def _selection_scores(state: RunState) -> dict[str, float]:
    """The held-out figures (val_acc, val_loss; test_* without a validation split) of the weights best/ holds, from
    the history row of its epoch."""
    epoch, prefix = state.best.get("epoch"), "ema_" if state.best.get("weights") == "ema" else ""
    rows = [r for r in state.history if r.get("epoch") == epoch]
    if not rows:
        return {}
    names = [f"{split}_{quantity}" for split in ("val", "test") for quantity in ("acc", "loss")]
    return {name: rows[0][prefix + name] for name in names if prefix + name in rows[0]}
