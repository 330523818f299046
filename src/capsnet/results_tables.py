"""Markdown tables made from the results data (capsnet.results): the README's model table and docs/results.md's
tables, each between a pair of marker comments that tools/render_results.py rewrites and tests/test_results.py
checks.

    <!-- results:NAME -->
    ...generated table...
    <!-- /results:NAME -->

Tables: `models` (README: every registered model, its sample and Fashion-MNIST accuracy, affine accuracy and
cost), `sample`, `fashion-mnist`, `cost` and `trainability` (docs/results.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .errors import CapsNetError
from .results import Row, read_rows

FILES = ("sample", "fashion-mnist", "cost", "trainability")  # results/NAME.csv


def load(results: str | Path) -> dict[str, list[Row]]:
    """Every results file under `results` by name ([] for one that is absent)."""
    root = Path(results)
    return {name: read_rows(root / f"{name}.csv") if (root / f"{name}.csv").is_file() else [] for name in FILES}


STOPPED = "stopped after the first epoch at val_acc"  # a protocol of runs ended by --stop-at-val-acc


def _pct(row: Row | None, *, affine: bool = False) -> str:
    if row is None:
        return "not measured yet"
    mean, std = (row.affine_acc_mean, row.affine_acc_std) if affine else (row.test_acc_mean, row.test_acc_std)
    if mean is None and row.status != "done":  # e.g. "not run: ...", with the command that makes the row
        return f"{row.status} (`{row.command}`)" if row.command else row.status
    if mean is None:
        return "not measured yet"
    seeds = len(row.seeds.split())
    spread = f" ± {std:.2f}" if seeds > 1 and std is not None else ""
    budget = f"≤ {row.epochs}" if STOPPED in row.protocol else f"{row.epochs}"  # (the note: the epochs each trained)
    return f"{mean:.2f}{spread}%" if affine else f"{mean:.2f}{spread}% ({seeds} seed{'s' * (seeds > 1)}, {budget} ep.)"


def _by_model(rows: Iterable[Row], precision: str | None = None) -> dict[str, Row]:
    """Each model's row (the `defaults` configuration; bf16 before fp32 unless `precision` is given)."""
    out: dict[str, Row] = {}
    for row in sorted(rows, key=lambda r: r.precision != "bf16"):
        if row.config == "defaults" and (precision is None or row.precision == precision):
            out.setdefault(row.model, row)
    return out


def _table(header: list[str], rows: list[list[str]], align: str) -> str:
    """A Markdown table; `align` has one letter per column: l (left) or r (right, numbers)."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def models_table(
    data: dict[str, list[Row]],
    models: list[str],
    shipped: Callable[[str], list[str]],
    paper: Callable[[str], str],
    not_shipped: dict[str, str] | None = None,
) -> str:
    """The README's table: one line per registered model; `not_shipped` says why a model ships no weights."""
    sample, fashion, cost = _by_model(data["sample"]), _by_model(data["fashion-mnist"]), _by_model(data["cost"])
    lines = []
    for name in models:
        s, f, c = sample.get(name), fashion.get(name), cost.get(name)
        params = next((r.params for r in (s, f, c) if r is not None and r.params), None)
        lines.append(
            [
                f"`{name}`",
                paper(name),
                f"{params:,}" if params else "—",
                ", ".join(f"`{t}`" for t in shipped(name)) or f"none: {(not_shipped or {}).get(name, '—')}",
                _pct(s),
                _pct(s, affine=True),
                _pct(f),
                f"{c.train_img_s:,.0f}" if c and c.train_img_s else "—",
            ]
        )
    header = [
        "`--model`",
        "paper",
        "parameters",
        "shipped weights",
        "bundled sample, test %",
        "sample, affine test %",
        "Fashion-MNIST, test %",
        "train img/s",
    ]
    return _table(header, lines, "llrlrrrr")


def accuracy_table(rows: list[Row], pending: Iterable[tuple[str, int | None, int, str]] = ()) -> str:
    """docs/results.md: a benchmark's rows with their seeds, budget, precision and command, then a "not measured
    yet" line for each (model, parameters, epochs, command) in `pending` that has no row."""
    measured = {r.model for r in rows}
    lines = [
        [
            f"`{r.model}`" + ("" if r.config == "defaults" else f" {r.config}"),
            f"{r.params:,}" if r.params else "—",
            str(r.epochs or "—"),
            str(r.batch_size or "—"),
            r.precision,
            _pct(r) if r.status == "done" else r.status if r.test_acc_mean is None else f"{_pct(r)}; {r.status}",
            r.test_acc or "—",
            _pct(r, affine=True) if r.test_acc_mean is not None else "—",
            f"`{r.command}`",
        ]
        for r in rows
    ]
    lines += [
        [
            f"`{m}`",
            f"{params:,}" if params else "—",
            str(epochs),
            "—",
            "—",
            "not measured yet",
            "—",
            "—",
            f"`{command}`",
        ]
        for m, params, epochs, command in pending
        if m not in measured
    ]
    header = [
        "model",
        "parameters",
        "epochs",
        "batch",
        "precision",
        "test % (mean ± std)",
        "each seed",
        "affine test %",
        "command",
    ]
    return _table(header, lines, "lrrrlrlrl")


def cost_table(rows: list[Row]) -> str:
    def num(v: float | None, fmt: str = ",.0f") -> str:
        return "—" if v is None else format(v, fmt)

    lines = [
        [
            f"`{r.model}`",
            r.precision,
            str(r.batch_size or "—"),
            num(r.train_img_s),
            num(r.infer_img_s_b1),
            num(r.infer_img_s_batch),
            num(r.peak_mem_mb),
            r.cpu,
        ]
        for r in rows
    ]
    header = [
        "model",
        "precision",
        "train batch",
        "train img/s",
        "infer img/s, batch 1",
        "infer img/s, batch 256",
        "peak MiB",
        "CPU",
    ]
    return _table(header, lines, "llrrrrrl")


def trainability_table(rows: list[Row]) -> str:
    """A line per model at its defaults, and one per other setting measured (its flags after the name)."""
    cases = sorted({r.benchmark.removeprefix("trainability:") for r in rows})
    cell = {(r.model, r.config, r.benchmark.removeprefix("trainability:")): r for r in rows}
    entries = list(dict.fromkeys((r.model, r.config) for r in rows))
    lines = [
        [f"`{m}`" if c == "defaults" else f"`{m}` `{c}`", *(_pct(cell.get((m, c, case))) for case in cases)]
        for m, c in entries
    ]
    return _table(["model", *(f"{c}, test %" for c in cases)], lines, "l" + "r" * len(cases))


def render_all(
    data: dict[str, list[Row]],
    models: list[str],
    shipped: Callable[[str], list[str]],
    paper: Callable[[str], str],
    plan: Callable[[str, str], tuple[int, str]] | None = None,
    not_shipped: dict[str, str] | None = None,
) -> dict[str, str]:
    """Every table by its marker name; `plan(benchmark, model)` gives the epochs and command of a model that has no
    row yet on that benchmark (listed as not measured)."""

    params = {r.model: r.params for rows in data.values() for r in rows if r.params}

    def pending(benchmark: str) -> list[tuple[str, int | None, int, str]]:
        return [(m, params.get(m), *plan(benchmark, m)) for m in models] if plan else []

    return {
        "models": models_table(data, models, shipped, paper, not_shipped),
        "sample": accuracy_table(data["sample"], pending("sample")),
        "fashion-mnist": accuracy_table(data["fashion-mnist"], pending("fashion-mnist")),
        "cost": cost_table(data["cost"]),
        "trainability": trainability_table(data["trainability"]),
    }


def fill(text: str, tables: dict[str, str], *, source: str) -> str:
    """`text` with each marked table replaced; CapsNetError naming `source` for a marker without its end."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in tables:
            raise CapsNetError(f"{source}: unknown results table {name!r}; known: {', '.join(tables)}")
        return f"<!-- results:{name} -->\n{tables[name]}\n<!-- /results:{name} -->"

    opened = re.findall(r"<!-- results:([\w-]+) -->", text)
    closed = re.findall(r"<!-- /results:([\w-]+) -->", text)
    if opened != closed:
        raise CapsNetError(f"{source}: results markers do not pair up ({opened} opened, {closed} closed)")
    return re.sub(r"<!-- results:([\w-]+) -->.*?<!-- /results:\1 -->", replace, text, flags=re.S)


__all__ = ["FILES", "accuracy_table", "cost_table", "fill", "load", "models_table", "render_all", "trainability_table"]
