"""The benchmark scripts that read checkpoints: their figures agree with the library's, and bad input is one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet
from capsnet.data import load_dataset

pytestmark = pytest.mark.tooling  # the project's tooling: `make test-tooling` and CI run it

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "routing_activity.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = CapsNet(config=small_config())
    out = tmp_path_factory.mktemp("routing") / "model"
    model.save_pretrained(out)
    return out, model


@pytest.mark.slow
def test_routing_activity_accuracies_match_the_model(model_dir):
    path, model = model_dir
    r = _run("--checkpoint", str(path), "--limit", "40", "--iterations", "1,3")
    assert r.returncode == 0, r.stderr
    rows = {int(line.split()[0]): line.split() for line in r.stdout.splitlines() if line[:1].isdigit()}
    assert set(rows) == {1, 3}
    assert rows[1][2] == "0"  # r = 1 never differs from itself
    split = load_dataset("mnist-sample").test
    x, y = split.images[:40].float() / 255, split.labels[:40]
    model.eval()
    for r_ in (1, 3):
        model.class_caps.iterations = r_
        with torch.no_grad():
            acc = (model(x).predictions == y).float().mean().item()
        assert float(rows[r_][1]) == pytest.approx(acc, abs=1e-4)
    assert "max_j c_ij" in r.stdout and "mean c_i,true class" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, needle",
    [
        (("--iterations", "0,3"), "--iterations"),
        (("--iterations", "a"), "--iterations"),
        (("--limit", "0"), "--limit"),
    ],
)
def test_routing_activity_bad_flags_one_line(model_dir, args, needle):
    r = _run("--checkpoint", str(model_dir[0]), *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


@pytest.mark.slow
def test_routing_activity_missing_checkpoint_one_line(tmp_path):
    r = _run("--checkpoint", str(tmp_path / "nowhere"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr


def _trainability():
    """benchmarks/trainability.py as a module."""
    import importlib.util

    path = SCRIPT.parent / "trainability.py"
    spec = importlib.util.spec_from_file_location("trainability_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_trainability_option_names_its_row_its_command_and_its_runs(tmp_path):
    script = _trainability()
    options = dict([script.option("p-model=skm"), script.option("routing_iterations=2")])
    assert options == {"p_model": "skm", "routing_iterations": 2}
    row = script.case_row("heinsen-capsnet", "shapes", options, epochs=10, seeds=3)
    assert row.config == "--p-model skm --routing-iterations 2"
    assert row.protocol.startswith("capsnet train --dataset FOLDER with --p-model skm --routing-iterations 2;")
    assert row.command.endswith('--seeds 3 --option p_model="skm" --option routing_iterations=2')
    assert script.case_row("heinsen-capsnet", "shapes", {}, epochs=10, seeds=3).config == "defaults"
    stopped = script.case_row("hvc-capsnet", "shapes", {}, epochs=10, seeds=3, stop_at=1.0)
    assert stopped.config == "defaults" and stopped.epochs == 10
    assert "at the model's defaults, stopped after the first epoch at val_acc >= 1.0;" in stopped.protocol
    assert stopped.command.endswith("--seeds 3 --stop-at-val-acc 1.0")
    runs = tmp_path / "runs" / "shapes" / "heinsen-capsnet"
    assert script.run_folder("heinsen-capsnet", "shapes", 1, {}, work=tmp_path) == runs / "seed-1"
    folder = script.run_folder("heinsen-capsnet", "shapes", 1, options, work=tmp_path)
    assert folder == runs / "p-model-skm-routing-iterations-2" / "seed-1"
    with pytest.raises(Exception, match="expected NAME=VALUE"):
        script.option("p_model")


def test_a_trainability_option_no_model_takes_is_one_line_and_exit_2():
    script = SCRIPT.parent / "trainability.py"
    argv = [sys.executable, str(script), "--models", "capsnet", "--cases", "shapes", "--option", "no_such=1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("trainability: error: ") and "no_such" in line
