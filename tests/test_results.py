"""The results data (capsnet.results): rows round-trip through CSV, merge by key, and refuse a file that is not one;
the tables rendered from it are the README's and docs/results.md's."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from capsnet.errors import CapsNetError
from capsnet.results import COLUMNS, KEY, Row, accuracy_stats, read_rows, rows_csv, with_accuracies, write_rows


def test_accuracy_stats_are_the_mean_and_sample_std():
    mean, std = accuracy_stats([98.0, 98.5, 99.0])
    assert mean == pytest.approx(98.5)
    assert std == pytest.approx(0.5)  # sample std: sqrt(((-.5)^2 + 0 + .5^2) / 2)
    assert accuracy_stats([97.25]) == (97.25, 0.0)


def test_a_row_round_trips_through_csv(tmp_path):
    row = with_accuracies(
        Row(model="capsnet", params=8215568, benchmark="sample", protocol="p", epochs=10, batch_size=16,
            train_img_s=123.456789, cpu="x, 2 cores", command='capsnet train --out "a b"'),
        [0, 1, 2], [98.1, 98.2, 98.35],
    )  # fmt: skip
    path = tmp_path / "r.csv"
    write_rows(path, [row])
    (back,) = read_rows(path)
    assert back.seeds == "0 1 2" and back.test_acc == "98.10 98.20 98.35"
    assert back.params == 8215568 and back.epochs == 10
    assert back.test_acc_mean == pytest.approx(98.2167, abs=1e-4)
    assert back.train_img_s == pytest.approx(123.4568)
    assert back.command == row.command and back.cpu == row.cpu
    assert back.affine_acc_mean is None  # empty: not measured
    assert path.read_text().splitlines()[0].split(",") == list(COLUMNS)


def test_write_rows_replaces_a_row_of_the_same_key_and_keeps_the_others(tmp_path):
    path = tmp_path / "r.csv"
    a = Row(model="a", benchmark="sample", test_acc_mean=90.0)
    b = Row(model="b", benchmark="sample", test_acc_mean=80.0)
    write_rows(path, [a, b])
    write_rows(path, [Row(model="a", benchmark="sample", test_acc_mean=95.0)])
    rows = {r.model: r for r in read_rows(path)}
    assert rows["a"].test_acc_mean == 95.0 and rows["b"].test_acc_mean == 80.0
    other = Row(model="a", benchmark="sample", precision="bf16", test_acc_mean=94.0)  # precision is in the key
    write_rows(path, [other])
    assert len(read_rows(path)) == 3 and "precision" in KEY


def test_a_file_that_is_not_results_is_one_error_naming_it(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("name,score\nx,1\n")
    with pytest.raises(CapsNetError, match=r"other\.csv: not a results file"):
        read_rows(path)
    path.write_text("model,epochs\nx,ten\n")
    with pytest.raises(CapsNetError, match="'epochs' holds 'ten'"):
        read_rows(path)


def test_numbers_are_written_short_and_exact_enough():
    text = rows_csv([Row(model="m", test_acc_mean=98.123456789, peak_mem_mb=12345.678, test_acc_std=math.nan)])
    values = dict(zip(COLUMNS, text.splitlines()[1].split(",")))
    assert values["test_acc_mean"] == "98.1235" and values["peak_mem_mb"] == "12345.678"
    assert values["test_acc_std"] == ""  # nan: not measured


def test_the_readme_and_docs_tables_agree_with_the_results_data():
    """tools/render_results.py --check: the README's model table and docs/results.md's tables are the ones rendered
    from results/*.csv, for every registered model."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "tools" / "render_results.py"), "--check"], cwd=root,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_benchmark_table_lists_every_model_without_a_row_with_its_command():
    """docs/results.md's accuracy tables: a measured row, then one "not measured yet" line per model that has no
    row, with its budget and the command that makes it; a measured model is not listed twice."""
    from capsnet.results_tables import accuracy_table

    row = with_accuracies(Row(model="capsnet", benchmark="sample", epochs=10, precision="bf16"), [0, 1], [98.0, 99.0])
    table = accuracy_table([row], [("capsnet", 8, 10, "cmd a"), ("baseline", 35_445_522, 10, "cmd b")])
    lines = table.splitlines()[2:]
    assert len(lines) == 2 and lines[0].startswith("| `capsnet` |")
    assert lines[1] == "| `baseline` | 35,445,522 | 10 | — | — | not measured yet | — | — | `cmd b` |"


def test_the_trainability_table_gives_a_setting_other_than_the_defaults_its_own_line():
    from capsnet.results_tables import STOPPED, trainability_table

    def row(config: str, accuracies: list[float]) -> Row:
        base = Row(model="heinsen-capsnet", config=config, benchmark="trainability:shapes", epochs=10)
        return with_accuracies(base, list(range(len(accuracies))), accuracies)

    lines = trainability_table([row("defaults", [33.0]), row("--p-model skm", [86.0, 90.0])]).splitlines()[2:]
    assert lines == [
        "| `heinsen-capsnet` | 33.00% (1 seed, 10 ep.) |",
        "| `heinsen-capsnet` `--p-model skm` | 88.00 ± 2.83% (2 seeds, 10 ep.) |",
    ]
    # runs ended by --stop-at-val-acc: the epochs are a budget (benchmarks/trainability.py's protocol says so)
    protocol = f"capsnet train --dataset FOLDER at the model's defaults, {STOPPED} >= 1.0; best/ on val_loss"
    stopped = dataclasses.replace(row("defaults", [96.0]), protocol=protocol)
    assert trainability_table([stopped]).splitlines()[2:] == ["| `heinsen-capsnet` | 96.00% (1 seed, ≤ 10 ep.) |"]
