"""The run folder's files and the checkpoint set that writes them, atomically: a kill never breaks the last one.

    RUN_DIR/config.json    {"train": TrainConfig, "model": CapsNetConfig}
    RUN_DIR/summary.csv    one row per epoch (COLUMNS)
    RUN_DIR/last/, best/   save_pretrained folders (config.json + model.safetensors; for a module of one's own,
                           trained by capsnet.fit, its state_dict in model.safetensors and a config.json naming its
                           class: `save_model`); best/ is the epoch the run's monitor chooses (by default the lowest
                           validation loss; the test split's without a validation split; the lowest training loss
                           with neither: capsnet.training.selection)
    RUN_DIR/state.pt       resumable state: weights, optimizer, scheduler, epoch/step, RNG states, history
                           (RNG: the CPU generator, every rank's augmentation stream, and on CUDA the device's
                           generator, e.g. for dropout)
    RUN_DIR/test.json      the test split scored once, at the end of the run, on best/ and on last/
    RUN_DIR/tb/            TensorBoard scalars, when tensorboard is installed

state.pt holds only tensors, numbers, strings, lists and dicts, so it loads with `torch.load(weights_only=True)`.

The set is consistent after a kill at any moment. Each file is written atomically, and state.pt is written first:
it is the commit point, and last/, best/ and summary.csv are views of it (last/ holds its weights; best/ does too
when that save made a new best). A kill after state.pt leaves the views one save behind, each still a whole,
earlier checkpoint; `--resume` rewrites them from state.pt (`restore_views`) before it trains on.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import IO, Any, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from .._version import __version__
from ..config import to_dict
from ..errors import CheckpointError
from ..fileio import atomic_open, atomic_write_bytes, atomic_write_json
from ..models.pretrained import CONFIG_NAME, WEIGHTS_NAME, Pretrained, lightning_hint
from ..models.registry import MODELS
from . import distributed as dist_utils

STATE_NAME = "state.pt"
STATE_FORMAT = 1  # state.pt's format_version (a state without one is format 1): the next change keys its reading on it
SUMMARY_NAME = "summary.csv"
TEST_NAME = "test.json"
COLUMNS = [
    "epoch",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "test_loss",
    "test_acc",
    "lr",
    "images_per_s",
    "seconds",
]
EMA_COLUMNS = ["ema_val_loss", "ema_val_acc", "ema_test_loss", "ema_test_acc"]  # --ema: its average's scores
# Models with class lengths: the held-out split's mean shortest and longest (capsnet.training.stuck reads them).
LENGTH_COLUMNS = ["shortest_length", "longest_length"]
# A row's val_* cells are blank without a validation split; its test_* cells are blank with one (the test split
# is then scored only at the end, into test.json).


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    """state.pt, atomically. A write that fails inside torch.save (a full disk) is the OSError it was, naming
    state.pt: torch's archive writer reports it as "RuntimeError: [enforce fail ...] unexpected pos" once it has
    written part of the archive."""
    with atomic_open(run_dir / STATE_NAME, "wb") as f:
        writer = _Writer(f)
        try:
            torch.save(state, cast(IO[bytes], writer))  # (torch.save calls write and flush)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None


class _Writer:
    """A file for torch.save that keeps the OSError its `write` raised (torch's writer turns it into another)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def load_state(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(run_dir) / STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {STATE_NAME} to resume from")
    with open(path, "rb"):  # (no permission: the OSError naming the path)
        pass
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except MemoryError:
        raise
    except Exception as e:  # the weights-only unpickler on foreign bytes raises many types (IndexError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise CheckpointError(f"{path}: not a capsnet training state")
    version = state.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > STATE_FORMAT:
        raise CheckpointError(
            f"{path}: format_version {version!r}, written by a newer capsnet (this one reads "
            f"{STATE_FORMAT}); upgrade capsnet"
        )
    missing = [key for key in STATE_REQUIRED if key not in state]
    if missing:
        raise CheckpointError(f"{path}: not a resumable capsnet training state (no {', '.join(missing)})")
    for key, kind in STATE_TYPES.items():
        if (key in state and not isinstance(state[key], kind)) or isinstance(state.get(key), bool):
            raise CheckpointError(f"{path}: not a capsnet training state ({key} is a {type(state[key]).__name__})")
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["model"].items()):
        raise CheckpointError(f"{path}: not a capsnet training state (model is not a state dict of tensors)")
    return state


# The entries of a state.pt that are read on resuming, and their types (a state.pt of other fields is refused).
STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "model": dict,
    "model_type": str,
    "model_config": (dict, type(None)),
    "optimizer": dict,
    "scheduler": dict,
    "epoch": int,
    "batch_in_epoch": int,
    "step": int,
    "best": (dict, type(None)),
    "history": list,
    "running": list,
    "rng": dict,
}
# The entries a resume cannot do without.
STATE_REQUIRED = (
    "model",
    "optimizer",
    "scheduler",
    "epoch",
    "batch_in_epoch",
    "step",
    "best",
    "history",
    "running",
    "rng",
)


def get_rng_states(device: torch.device, augment_rng: torch.Generator, dist) -> dict[str, Any]:
    """The random streams a resume restores: {"torch": CPU state, "augment": [every rank's augmentation stream],
    "cuda": the training GPU's default generator (only when training on CUDA)}. A collective under torchrun (the
    augmentation streams are gathered to every rank), so every rank must call it."""
    augment = [augment_rng.get_state()]
    if dist.enabled:
        augment = [torch.empty_like(augment[0]) for _ in range(dist.world_size)]
        torch.distributed.all_gather_object(augment, augment_rng.get_state())
    states = {"torch": torch.get_rng_state(), "augment": [r.cpu() for r in augment]}
    if device.type == "cuda":  # (all ranks draw alike from it, so rank 0's stands for every rank's)
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Any], device: torch.device, augment_rng: torch.Generator, dist) -> None:
    """Restore what `get_rng_states` saved: each rank's augmentation stream when the number of processes is
    the same, and the CUDA generator when the state has one and the run is on CUDA (older states have none)."""
    torch.set_rng_state(states["torch"].cpu())
    saved = states["augment"]
    if len(saved) == dist.world_size:  # same number of processes: continue each stream exactly
        augment_rng.set_state(saved[dist.rank].cpu())
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def write_summary(run_dir: Path, history: list[dict[str, float]]) -> None:
    """Rewrite summary.csv from the whole history (so a resumed run never duplicates a row)."""
    buf = io.StringIO()
    extra = [k for k in EMA_COLUMNS + LENGTH_COLUMNS if any(k in row for row in history)]  # (only runs with them)
    columns = COLUMNS[:-3] + extra + COLUMNS[-3:]
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: _fmt(row.get(k, math.nan)) for k in columns})
    with atomic_open(run_dir / SUMMARY_NAME, "w") as f:
        f.write(buf.getvalue())


def read_summary(run_dir: str | os.PathLike) -> list[dict[str, float]]:
    """The rows of a run's summary.csv (`run_dir` is the run folder or the file itself), as floats; a blank
    cell reads as NaN. An empty list when no epoch is recorded yet."""
    path = Path(run_dir)
    path = path / SUMMARY_NAME if path.is_dir() else path
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {SUMMARY_NAME}")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return [{k: float(v) if v != "" else math.nan for k, v in row.items()} for row in csv.DictReader(f)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed ({e})") from None


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return ""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.6g}"


def restore_views(
    run_dir: Path,
    state: dict[str, Any],
    model: torch.nn.Module,
    *,
    is_main: bool = True,
    best_model: torch.nn.Module | None = None,
) -> None:
    """Rewrite the views of `state` (a state.pt just loaded into `model`): last/ from its weights, best/ too when
    that save made the best (from `best_model`: the moving average when best/ holds it), summary.csv from its
    history."""
    if not is_main:
        return
    save_model(model, run_dir / "last", metadata=view_metadata(state, "last"))
    best = state.get("best") or {}
    if best.get("step") == state["step"] and best.get("epoch") == state["epoch"]:
        save_model(best_model or model, run_dir / "best", metadata=view_metadata(state, "best"))
    write_summary(run_dir, list(state["history"]))


def model_name(model: torch.nn.Module) -> str:
    """What a run records of its model: a registered model's name, else the module's qualified class name."""
    model_type = getattr(model, "model_type", None)
    if isinstance(model_type, str):
        return MODELS.canonical(model_type) if model_type in MODELS else model_type
    return f"{type(model).__module__}.{type(model).__qualname__}"


def load_weights(model: torch.nn.Module, path: Path, *, device: torch.device) -> None:
    """A view's model.safetensors loaded into `model`, strictly; CheckpointError (one line) when it cannot be read or
    does not fit."""
    try:
        state = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = " ".join(line.strip() for line in str(e).strip().splitlines()[:2])
        raise CheckpointError(f"{path}: weights do not fit the run's {model_name(model)} ({first})") from None


def save_model(model: torch.nn.Module, folder: Path, *, metadata: dict[str, Any]) -> None:
    """A view of the run's model: its save_pretrained folder (a capsnet model); for a module of one's own, its
    state_dict as model.safetensors (loadable with `model.load_state_dict(safetensors.torch.load_file(...))`) and a
    config.json naming its class. Each file is written atomically, the weights first."""
    if isinstance(model, Pretrained):
        model.save_pretrained(folder, metadata=metadata)
        return
    folder.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{type(model).__name__}.state_dict()[{key!r}] is not a tensor; safetensors holds tensors only"
            )
        value = value.detach().cpu().contiguous()
        shared = value.untyped_storage().data_ptr() in seen  # (tied weights: each key gets its own copy)
        seen.add(value.untyped_storage().data_ptr())
        tensors[key] = value.clone() if shared else value
    atomic_write_bytes(folder / WEIGHTS_NAME, save(tensors, metadata={"format": "pt"}))
    meta = {
        "module": model_name(model),
        "format": "state_dict",
        "capsnet_version": __version__,
        "load": "model.load_state_dict(safetensors.torch.load_file('model.safetensors'))",
        "checkpoint": metadata,
    }
    atomic_write_json(folder / CONFIG_NAME, meta)


def remove_strays(run_dir: Path) -> None:
    """Remove the temporary files (`.NAME.*.tmp`, see capsnet.fileio.atomic_open) that a kill left in a run folder."""
    for folder in (run_dir, run_dir / "last", run_dir / "best"):
        for stray in folder.glob(".*.tmp") if folder.is_dir() else ():
            stray.unlink(missing_ok=True)


def view_metadata(state: dict[str, Any], view: str) -> dict[str, Any]:
    """What a view's config.json records of the checkpoint: which view, epoch and step, and for best/ the metric
    it was chosen on and its value (so `capsnet evaluate` can say what it scored)."""
    meta: dict[str, Any] = {"view": view, "epoch": state["epoch"], "step": state["step"]}
    if view == "best" and state.get("best"):
        meta.update(selected_on=state["best"]["metric"], value=state["best"]["value"])
        meta.update({k: state["best"][k] for k in ("monitor", "weights") if k in state["best"]})
    return meta


def checkpoint_info(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The "checkpoint" record of a save_pretrained folder written by a training run (see `view_metadata`),
    or None for a folder without one (written by save_pretrained directly, or by a capsnet before 0.2)."""
    try:
        meta = json.loads((Path(folder) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    info = meta.get("checkpoint") if isinstance(meta, dict) else None
    return info if isinstance(info, dict) else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The `save_pretrained` folder a checkpoint argument names: a run folder's `best/` (falling back to
    `last/`), or the argument itself when it holds `model.safetensors`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{path}: no such checkpoint (give a run folder or a save_pretrained folder)")
    if not p.is_dir():
        raise CheckpointError(
            f"{path}: not a folder (give a run folder or a save_pretrained folder){lightning_hint(p)}"
        )
    for sub in ("best", "last"):
        if (p / sub / CONFIG_NAME).is_file():
            return p / sub
    if (p / WEIGHTS_NAME).is_file():
        return p
    if (p / SUMMARY_NAME).is_file() or (p / "state.pt").is_file() or _is_run_config(p / CONFIG_NAME):
        raise CheckpointError(f"{path}: a training run folder without a checkpoint yet (no best/ or last/)")
    if (p / CONFIG_NAME).is_file():
        return p  # load_pretrained names what is missing or wrong
    raise CheckpointError(
        f"{path}: neither a run folder (with best/ or last/) nor a save_pretrained folder "
        f"({CONFIG_NAME} + {WEIGHTS_NAME}){lightning_hint(p)}"
    )


def _is_run_config(path: Path) -> bool:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(meta, dict) and "train" in meta and "model_type" not in meta


# ----------------------------------------------------------------------------------------------- the set
def save_checkpoint(run: Any, state: Any, *, epoch_done: bool) -> None:
    """The checkpoint set of `run` (a capsnet.training.build.Run) at `state` (a capsnet.training.state.RunState),
    on rank 0 (with every rank's augmentation stream): state.pt first, the commit point; then its views last/,
    best/ (when this epoch is the new best) and summary.csv."""
    rng = get_rng_states(run.device, run.augment_rng, run.dist)  # a collective under torchrun: every rank calls it
    running = [0.0] * 4 if epoch_done else dist_utils.all_sum(state.sums.to_list(), run.dist, run.device)
    if not run.dist.is_main:
        return
    saved = {
        "format_version": STATE_FORMAT,
        "model": run.model.state_dict(),
        "model_type": model_name(run.model),
        "model_config": to_dict(run.model_config) if run.model_config is not None else None,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "epoch": state.epoch + (1 if epoch_done else 0),
        "batch_in_epoch": 0 if epoch_done else state.batch_in_epoch,
        "step": state.step,
        "best": state.best,
        "validation": getattr(run.task, "recorded", {}).get("validation"),
        "data": getattr(run.task, "recorded", {}).get("data"),
        "history": state.history,
        "running": running,  # [loss sum, correct, count, seconds], summed over the ranks
        "running_ranks": run.dist.world_size,
        "rng": rng,
    }
    if run.ema is not None:
        saved["ema"] = run.ema.state_dict()
    save_state(run.dir, saved)
    save_model(run.model, run.dir / "last", metadata=view_metadata(saved, "last"))
    if epoch_done and state.best.get("step") == state.step:
        save_model(best_model_of(run, state.best), run.dir / "best", metadata=view_metadata(saved, "best"))
    write_summary(run.dir, state.history)


def best_model_of(run: Any, best: dict[str, Any]) -> torch.nn.Module:
    """The weights best/ holds when this checkpoint is the best: the moving average's (--ema) or the model's."""
    return run.ema.model if run.ema is not None and best.get("weights") == "ema" else run.model
