"""benchmarks/gpu_zoo.py: which rows it trains and in what order, its time limit, its rows' notes, the merge into
results/, and bad input (the trainings themselves need a GPU; `capsnet reproduce zoo` is tested on its own)."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsnet.models.registry import MODELS
from capsnet.results import Row, read_rows, with_accuracies, write_rows

pytestmark = pytest.mark.tooling  # the project's tooling: `make test-tooling` and CI run it

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_zoo.py"
_spec = importlib.util.spec_from_file_location("gpu_zoo", SCRIPT)
gpu_zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_zoo)


def _row(model: str, seeds: list[int], **kw) -> Row:
    row = Row(model=model, benchmark="fashion-mnist", protocol="p", precision="bf16", batch_size=16, **kw)
    return with_accuracies(row, seeds, [90.0 + s for s in seeds])


def _cost(model: str, img_s: float) -> Row:
    return Row(model=model, benchmark="cost", protocol="c", precision="bf16", batch_size=16, train_img_s=img_s)


def test_the_missing_rows_go_first_the_slowest_on_a_cpu_first(tmp_path):
    write_rows(tmp_path / "fashion-mnist.csv", [_row("capsnet", [0]), _row("efficient-capsnet", [0, 1, 2])])
    write_rows(tmp_path / "cost.csv", [_cost("baseline", 30.0), _cost("em-capsnet", 10.0), _cost("capsnet", 50.0)])
    write_rows(tmp_path / "cost.csv", [_cost("deepcaps", 20.0)])
    models = gpu_zoo.wanted_models(tmp_path, 3, "bf16")
    assert set(models) == set(MODELS) - {"efficient-capsnet", "em-capsnet"}  # done; too slow on a GPU too
    assert models[:2] == ["deepcaps", "baseline"]  # no row: 20 and 30 img/s, then those without a speed
    assert models[-1] == "capsnet"  # its row has 1 seed of 3: after every model without a row


def test_every_seed_of_the_rowless_models_goes_before_the_short_rows():
    assert gpu_zoo.jobs_in_order(["a", "b"], 2) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    jobs = gpu_zoo.jobs_in_order(["a", "b", "c"], 2, first={"b", "c"})
    assert jobs == [("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 0), ("a", 1)]


def test_jobs_run_a_few_at_a_time_and_those_running_at_the_limit_are_stopped(tmp_path):
    def command(job):
        seconds = 0.1 if job[0] == "quick" else 60
        return [sys.executable, "-c", f"import time; time.sleep({seconds}); print('{job[0]}')"]

    jobs = [("quick", 0), ("slow", 0), ("quick", 1), ("never", 0)]
    start = time.monotonic()
    done = gpu_zoo.run_jobs(jobs, command, parallel=2, until=start + 3.0, logs=tmp_path)
    assert sorted(done) == [("quick", 0), ("quick", 1)] and time.monotonic() - start < 30
    assert (tmp_path / "quick-seed-1.log").read_text().strip() == "quick"
    assert (tmp_path / "slow-seed-0.log").exists() and (tmp_path / "never-seed-0.log").exists()  # all started


def test_a_row_takes_the_seeds_that_finished_before_the_first_that_did_not():
    finished = {("a", 0), ("a", 1), ("b", 1), ("c", 0), ("c", 1), ("c", 2)}
    prefix = {m: gpu_zoo.finished_prefix(m, lambda m, s: (m, s) in finished, 3) for m in "abc"}
    assert prefix == {"a": 2, "b": 0, "c": 3}


def test_rows_of_fewer_seeds_say_so_and_merge_into_results(tmp_path):
    out = tmp_path / "fashion-mnist.csv"
    write_rows(out, [_row("baseline", [0, 1, 2]), _row("em-capsnet", [0], note="on a GPU")])
    gpu_zoo.note_short_rows(out, 3)
    notes = {r.model: r.note for r in read_rows(out)}
    assert notes == {"baseline": "", "em-capsnet": "on a GPU; seeds 0 of the 3 planned: the GPU session's time ended"}
    results = tmp_path / "results"
    results.mkdir()
    write_rows(results / "fashion-mnist.csv", [_row("capsnet", [0]), _row("baseline", [0])])
    assert gpu_zoo.main(["--merge", str(out), "--results", str(results)]) == 0
    merged = {r.model: r.seeds for r in read_rows(results / "fashion-mnist.csv")}
    assert merged == {"capsnet": "0", "baseline": "0 1 2", "em-capsnet": "0"}  # baseline's row replaced


def test_a_merge_keeps_a_row_of_more_seeds(tmp_path, capsys):
    out = tmp_path / "fashion-mnist.csv"
    write_rows(out, [_row("baseline", [0]), _row("capsnet", [0, 1])])
    results = tmp_path / "results"
    results.mkdir()
    write_rows(results / "fashion-mnist.csv", [_row("baseline", [0, 1, 2]), _row("capsnet", [0, 1])])
    assert gpu_zoo.main(["--merge", str(out), "--results", str(results)]) == 0
    merged = {r.model: r.seeds for r in read_rows(results / "fashion-mnist.csv")}
    assert merged == {"baseline": "0 1 2", "capsnet": "0 1"}
    said = capsys.readouterr().out.splitlines()
    assert said[-1].startswith("kept ") and said[-1].endswith("row of baseline: 3 seeds, against 1 here")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--merge", "nowhere.csv"], "--merge: no such file: nowhere.csv"),
        ([], "--out is needed (or --merge)"),
        (["--out", "o", "--models", "capsnet,nomodel"], "--models: unknown model 'nomodel'"),
        (["--out", "o", "--dataset", "no/such/folder"], "--dataset: no such folder: no/such/folder"),
        (["--out", "o", "--minutes", "0"], "--minutes must be positive, got 0.0"),
        (["--out", "o", "--parallel", "-1"], "--parallel must be positive, got -1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "o").exists()
