"""The training run folder, written atomically so that a kill at any moment leaves the previous checkpoint intact.

    RUN_DIR/config.json    {"train": TrainConfig, "model": CapsNetConfig}
    RUN_DIR/summary.csv    one row per epoch (COLUMNS)
    RUN_DIR/last/, best/   save_pretrained folders (config.json + model.safetensors)
    RUN_DIR/state.pt       resumable state: weights, optimizer, scheduler, epoch/step, RNG states, history
    RUN_DIR/tb/            TensorBoard scalars, when tensorboard is installed

state.pt holds only tensors, numbers, strings, lists and dicts, so it loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..fileio import atomic_open
from ..models.pretrained import CONFIG_NAME, WEIGHTS_NAME

STATE_NAME = "state.pt"
SUMMARY_NAME = "summary.csv"
COLUMNS = ["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "images_per_s", "seconds"]


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    with atomic_open(run_dir / STATE_NAME, "wb") as f:
        torch.save(state, f)


def load_state(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(run_dir) / STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {STATE_NAME} to resume from")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot be loaded ({first})") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise CheckpointError(f"{path}: not a capsnet training state")
    return state


def write_summary(run_dir: Path, history: list[dict[str, float]]) -> None:
    """Rewrite summary.csv from the whole history (so a resumed run never duplicates a row)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: _fmt(row[k]) for k in COLUMNS})
    with atomic_open(run_dir / SUMMARY_NAME, "w") as f:
        f.write(buf.getvalue())


def read_summary(run_dir: Path) -> list[dict[str, float]]:
    path = Path(run_dir) / SUMMARY_NAME
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: no {SUMMARY_NAME}")
    with open(path, newline="", encoding="utf-8") as f:
        try:
            return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed ({e})") from None


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.6g}"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The `save_pretrained` folder a checkpoint argument names: a run folder's `best/` (falling back to
    `last/`), or the argument itself when it holds `model.safetensors`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{path}: no such checkpoint (give a run folder or a save_pretrained folder)")
    if not p.is_dir():
        raise CheckpointError(f"{path}: not a folder (give a run folder or a save_pretrained folder)")
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
        f"({CONFIG_NAME} + {WEIGHTS_NAME})"
    )


def _is_run_config(path: Path) -> bool:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(meta, dict) and "train" in meta and "model_type" not in meta
