"""The project's measured results as data: one CSV row per model × benchmark × protocol in results/*.csv.

Each row says what ran (model, its configuration, parameters, data set and split sizes, epochs, batch, precision,
seeds), what it scored (each seed's test accuracy of the validation-chosen checkpoint, their mean and std, and the
accuracy on affine-transformed test images), what it cost (training and inference images per second, peak memory)
and where it came from (CPU, torch, capsnet commit, the exact command). `capsnet reproduce zoo` and `capsnet compare`
write rows; tools/render_results.py renders the README's model table and docs/results.md's tables from them.

Torch-free: reading and rendering the data needs no model.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .errors import CapsNetError
from .fileio import atomic_write_bytes

# A row's identity: a second row with the same key replaces the first (write_rows).
KEY = ("model", "config", "benchmark", "protocol", "precision")


@dataclass(frozen=True)
class Row:
    """One measured configuration. Accuracies are percentages; empty strings are "not measured"."""

    model: str  # registered model name
    config: str = "defaults"  # what differs from the model's defaults: "defaults", or flags such as "--routing x"
    params: int | None = None  # trainable parameters
    benchmark: str = ""  # data set: "mnist-sample", "fashion-mnist", a trainability case, ...
    protocol: str = ""  # how the figure was chosen, e.g. "best/ on val_loss, test scored once"
    train_images: int | None = None
    val_images: int | None = None
    test_images: int | None = None
    epochs: int | None = None
    batch_size: int | None = None
    precision: str = "fp32"
    seeds: str = ""  # space-separated, e.g. "0 1 2"
    test_acc: str = ""  # each seed's test accuracy (%), space-separated in the order of `seeds`
    test_acc_mean: float | None = None
    test_acc_std: float | None = None  # sample standard deviation over the seeds (0 for one seed)
    affine_acc_mean: float | None = None  # the same checkpoints on the affine-transformed test images (%)
    affine_acc_std: float | None = None
    train_img_s: float | None = None  # training images per second (forward, loss, backward, Adam)
    infer_img_s_b1: float | None = None  # inference images per second at batch 1
    infer_img_s_batch: float | None = None  # inference images per second at batch `infer_batch`
    infer_batch: int | None = None
    peak_mem_mb: float | None = None  # peak memory of a training step (MiB)
    routing_spread: float | None = None  # how far routing weights move from uniform (capsnet.routing.base)
    cpu: str = ""  # the host's CPU model (or GPU name), as `lscpu` / torch reports it
    torch: str = ""
    commit: str = ""  # capsnet's git commit
    command: str = ""  # the command that makes this row
    status: str = "done"  # "done", or why not: "not run: needs a GPU", "1 seed: ...", "running"
    note: str = ""


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Row))
_TYPES = {f.name: f.type for f in fields(Row)}


def accuracy_stats(accuracies: Sequence[float]) -> tuple[float, float]:
    """(mean, sample std) of per-seed accuracies; std 0 for one seed."""
    mean = statistics.fmean(accuracies)
    return mean, statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0


def _parse(name: str, text: str) -> Any:
    kind = str(_TYPES[name])
    if text == "" and "None" in kind:
        return None
    try:
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise CapsNetError(f"results: column {name!r} holds {text!r}, not a number") from None
    return text


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if not math.isfinite(value) or abs(value) >= 1e4 else f"{round(value, 4):g}"
    return str(value)


def read_rows(path: str | Path) -> list[Row]:
    """The rows of a results CSV; CapsNetError naming the file for a missing or unknown column."""
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        unknown = [c for c in header if c not in COLUMNS]
        if unknown or "model" not in header:
            raise CapsNetError(f"{path}: not a results file (unknown columns {unknown}, known: {', '.join(COLUMNS)})")
        return [Row(**{k: _parse(k, v) for k, v in record.items() if k in COLUMNS}) for record in reader]


def rows_csv(rows: Iterable[Row]) -> str:
    """Rows as CSV text with every column, in COLUMNS order."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(_format(v) for v in asdict(row).values())
    return out.getvalue()


def row_key(row: Row) -> tuple[str, ...]:
    return tuple(str(getattr(row, k)) for k in KEY)


def write_rows(path: str | Path, rows: Iterable[Row]) -> None:
    """Add `rows` to the CSV at `path` (made if absent), replacing rows with the same KEY; atomic."""
    path = Path(path)
    merged = {row_key(r): r for r in (read_rows(path) if path.exists() else [])}
    merged.update({row_key(r): r for r in rows})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, rows_csv(merged.values()).encode())


def with_accuracies(row: Row, seeds: Sequence[int], accuracies: Sequence[float]) -> Row:
    """`row` with its seeds, per-seed test accuracies (%) and their mean and std filled in."""
    mean, std = accuracy_stats(accuracies)
    per_seed = " ".join(f"{a:.2f}" for a in accuracies)
    return replace(row, seeds=" ".join(map(str, seeds)), test_acc=per_seed, test_acc_mean=mean, test_acc_std=std)


__all__ = [
    "COLUMNS",
    "KEY",
    "Row",
    "accuracy_stats",
    "read_rows",
    "row_key",
    "rows_csv",
    "with_accuracies",
    "write_rows",
]
