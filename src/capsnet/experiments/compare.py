"""`capsnet compare`: routings and models, built-in or plugins, trained on the same data with the same budget and
seeds, each with its own defaults, then measured alike (capsnet.experiments.measure) and reported as rows of the
results data (capsnet.results) and a Markdown table.

An entry is the paper's CapsNet with one `--routing` (routing entries) or a registered model with its defaults
(model entries). Each entry and seed trains in a fresh Python process (`python -m capsnet.experiments.measure`), so
that its peak memory is its own; what it prints is passed on, prefixed with the entry, and its last line is the
measurement. Every name and setting is checked before anything trains: a bad one is a ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import from_dict
from ..configs.routings import fully_connected, routing_record
from ..data.datasets import dataset_format
from ..errors import ConfigError
from ..fileio import atomic_write_bytes
from ..models.registry import MODELS
from ..results import Row, accuracy_stats, with_accuracies, write_rows
from ..training.config import TrainConfig
from ..training.hardware import resolve_device
from .measure import INFER_BATCH, INFER_SECONDS, RESULT_PREFIX

RESULTS_NAME, TABLE_NAME = "results.csv", "compare.md"


@dataclass(frozen=True)
class Entry:
    """One thing compared: registered model `model` with config `overrides` (its defaults otherwise)."""

    label: str  # "capsnet --routing dynamic", "efficient-capsnet"
    model: str
    overrides: dict[str, Any]
    config: str  # the results row's `config`: what differs from the model's defaults
    folder: str  # the entry's run folder under --out


def entries(routings: Sequence[str] | None, models: Sequence[str] | None, options: dict[str, Any]) -> list[Entry]:
    """The entries `--routings` and `--models` name (neither: every built-in routing, then every registered model
    but CapsNet, installed plugins' included), each checked: its name known (a plugin's loaded) and its config, with
    the `options` (model config fields: applied to each entry whose config has them), valid."""
    if routings is None and models is None:
        failed = MODELS.load_plugins()
        if failed:
            raise ConfigError(failed[0])
        routings, models = fully_connected(), [m for m in MODELS if m != "capsnet"]
    found = [_routing_entry(r, options) for r in routings or []]
    found += [_model_entry(m, options) for m in models or []]
    if not found:
        raise ConfigError("nothing to compare: name --routings and/or --models")
    labels = [e.label for e in found]
    if len(set(labels)) < len(labels):
        raise ConfigError(f"an entry is named twice: {', '.join(sorted({x for x in labels if labels.count(x) > 1}))}")
    unused = sorted(set(options) - {k for e in found for k in e.overrides})
    if unused:
        raise ConfigError(f"--option {', '.join(unused)}: no compared model takes it")
    return found


def _routing_entry(name: str, options: dict[str, Any]) -> Entry:
    routing_record(name)  # known (a plugin's: loaded), with a fully connected layer
    taken = _taken("capsnet", {**options, "routing": name})
    flags = " ".join(f"--{k.replace('_', '-')} {_flag_value(v)}" for k, v in taken.items() if k != "routing")
    return Entry(f"capsnet --routing {name}", "capsnet", taken, f"--routing {name} {flags}".strip(), f"routing-{name}")


def _model_entry(name: str, options: dict[str, Any]) -> Entry:
    model = MODELS.canonical(name)
    taken = _taken(model, options)
    flags = " ".join(f"--{k.replace('_', '-')} {_flag_value(v)}" for k, v in taken.items())
    return Entry(model, model, taken, flags or "defaults", f"model-{model}")


def _taken(model: str, options: dict[str, Any]) -> dict[str, Any]:
    """The `options` that `model`'s config has; the config they make is checked (ConfigError)."""
    config_class = MODELS[model].config_class
    names = {f.name for f in dataclasses.fields(config_class)}
    taken = {k: v for k, v in options.items() if k in names}
    from_dict(config_class, taken, what=f"--model {model}")
    return taken


def _flag_value(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def train_settings(shared: dict[str, Any]) -> dict[str, Any]:
    """The TrainConfig fields of `shared` that were given (not None), checked before anything trains: as TrainConfig
    checks them, the device there, the data set found (nothing is loaded or downloaded)."""
    given = {k: v for k, v in shared.items() if v is not None}
    config = from_dict(TrainConfig, given, what="capsnet compare")
    resolve_device(config.device)
    dataset_format(config.dataset, data_dir=config.data_dir)
    return given


def run_entry(
    entry: Entry,
    seed: int,
    *,
    settings: dict[str, Any],
    out: Path,
    infer_batch: int,
    infer_seconds: float = INFER_SECONDS,
    echo: Callable[[str], None],
) -> dict[str, Any]:
    """Train and measure `entry` with `seed` in a fresh process; its measurement (capsnet.experiments.measure).
    ConfigError with the child's last error line if it fails."""
    folder = out / entry.folder / f"seed-{seed}"
    train = {
        **settings,
        "seed": seed,
        "out": str(folder),
        "progress": False,
        "tensorboard": False,
        "resume": (folder / "state.pt").is_file(),
    }
    spec = {
        "model": entry.model,
        "overrides": entry.overrides,
        "train": train,
        "infer_batch": infer_batch,
        "infer_seconds": infer_seconds,
    }
    argv = [sys.executable, "-m", "capsnet.experiments.measure", json.dumps(spec)]
    result = None
    with tempfile.TemporaryFile("w+") as stderr:  # (a file: a pipe read only at the end could fill and block it)
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
            elif line.strip():
                echo(f"[{entry.label}, seed {seed}] {line.rstrip()}")
        child.wait()
        stderr.seek(0)
        errors = stderr.read().strip().splitlines()
    if child.returncode != 0 or result is None:
        raise ConfigError(f"{entry.label} (seed {seed}): {errors[-1] if errors else f'exit status {child.returncode}'}")
    return result


def make_row(
    entry: Entry, seeds: Sequence[int], runs: Sequence[dict[str, Any]], *, benchmark: str, command: str
) -> Row:
    """The results row of `entry` from its runs, one per seed: accuracies as percentages (mean and sample std over
    the seeds), speeds and routing spread averaged, the peak memory the largest."""
    first = runs[0]

    def mean(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    affine = [100 * r["affine_acc"] for r in runs]
    affine_mean, affine_std = accuracy_stats(affine)
    row = Row(
        model=entry.model,
        config=entry.config,
        params=first["params"],
        benchmark=benchmark,
        protocol=first["protocol"],
        train_images=first["train_images"],
        val_images=first["val_images"],
        test_images=first["test_images"],
        epochs=first["epochs"],
        batch_size=first["batch_size"],
        precision=first["precision"],
        affine_acc_mean=affine_mean,
        affine_acc_std=affine_std,
        train_img_s=mean("train_img_s"),
        infer_img_s_b1=mean("infer_img_s_b1"),
        infer_img_s_batch=mean("infer_img_s_batch"),
        infer_batch=first["infer_batch"],
        peak_mem_mb=max(r["peak_mem_mb"] for r in runs),
        routing_spread=mean("routing_spread"),
        cpu=first["cpu"],
        torch=first["torch"],
        commit=first["commit"],
        command=command,
        note=first["note"],
    )
    return with_accuracies(row, seeds, [100 * r["test_acc"] for r in runs])


def compare(
    found: Sequence[Entry],
    *,
    settings: dict[str, Any],
    seeds: Sequence[int],
    out: str | Path,
    command: str,
    infer_batch: int = INFER_BATCH,
    infer_seconds: float = INFER_SECONDS,
    echo: Callable[[str], None] = print,
) -> tuple[list[Row], list[str]]:
    """Train and measure every entry with every seed; write OUT/results.csv (merged by key) and OUT/compare.md
    after each entry. Returns the rows and the lines of the entries that failed (the others still run)."""
    out = Path(out)
    rows: list[Row] = []
    failed: list[str] = []
    benchmark = str(settings.get("dataset", TrainConfig.__dataclass_fields__["dataset"].default))
    for entry in found:
        try:
            runs = [
                run_entry(
                    entry,
                    s,
                    settings=settings,
                    out=out,
                    infer_batch=infer_batch,
                    infer_seconds=infer_seconds,
                    echo=echo,
                )
                for s in seeds
            ]
        except ConfigError as e:
            failed.append(str(e))
            echo(f"failed: {e}")
            continue
        rows.append(make_row(entry, seeds, runs, benchmark=benchmark, command=command))
        echo(table_line(entry.label, rows[-1]))
        write_rows(out / RESULTS_NAME, rows[-1:])
        atomic_write_bytes(out / TABLE_NAME, markdown(found, rows, settings, seeds).encode())
    return rows, failed


HEADER = (
    "| entry | parameters | test acc % | affine acc % | train img/s | infer img/s (1 / batch) | peak MiB | "
    "routing spread |\n|---|---:|---:|---:|---:|---:|---:|---:|"
)


def table_line(label: str, row: Row) -> str:
    """One entry's line of the Markdown table."""

    def num(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    spread = "±" if row.test_acc_std else ""
    acc = f"{row.test_acc_mean:.2f}" + (f" ± {row.test_acc_std:.2f}" if spread else "")
    affine = num(row.affine_acc_mean, ".2f") + (f" ± {row.affine_acc_std:.2f}" if spread else "")
    return (
        f"| {label} | {row.params:,} | {acc} | {affine} | {num(row.train_img_s, ',.0f')} | "
        f"{num(row.infer_img_s_b1, ',.0f')} / {num(row.infer_img_s_batch, ',.0f')} | "
        f"{num(row.peak_mem_mb, ',.0f')} | {num(row.routing_spread, '.2f')} |"
    )


def markdown(found: Sequence[Entry], rows: Sequence[Row], settings: dict[str, Any], seeds: Sequence[int]) -> str:
    """The comparison as Markdown: what was run, then one line per entry measured."""
    given = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in settings.items()) or "capsnet train's defaults"
    labels = {(e.model, e.config): e.label for e in found}
    lines = [f"{given}; seeds {' '.join(map(str, seeds))}; {rows[0].protocol if rows else ''}", "", HEADER]
    lines += [table_line(labels[(r.model, r.config)], r) for r in rows]
    return "\n".join(lines) + "\n"


__all__ = ["Entry", "compare", "entries", "make_row", "markdown", "run_entry", "train_settings"]
