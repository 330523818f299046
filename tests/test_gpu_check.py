"""benchmarks/gpu_check.py end to end, in its CPU dry-run mode (the real check needs a CUDA GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tooling  # the project's tooling: `make test-tooling` and CI run it

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


VARIANTS = ["fp32", "bf16+graphs", "bf16+triton+cl+bench", "bf16+compile"]


@pytest.mark.slow
def test_gpu_check_smoke_run_writes_its_report(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--skip-tests", "--profile",
                        "--variants", *VARIANTS, "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    runs = [(e["loop"], e["variant"]) for e in report["epochs"]]
    assert runs == [("labml", "fp32")] + [("capsnet", v) for v in VARIANTS]  # in the order given
    assert all(e["images_per_s"] > 0 and e["batch"] == 32 for e in report["epochs"])
    assert "--cuda-graphs: needs a CUDA device, not cpu; training eagerly" in r.stderr  # (graphs fall back here)
    assert len(report["accuracy"]["val_acc"]) == 1 and report["smoke"]
    assert report["accuracy"]["test"]["best"]["epoch"] == 1
    profiles = {(p["variant"], p["batch"]): p for p in report["profile"]}
    assert set(profiles) == {("fp32", 32), ("bf16", 32)}
    for p in profiles.values():
        assert {"conv", "routing", "decoder", "loss", "optimizer", "data"} <= {ph["phase"] for ph in p["phases"]}
        assert p["launches_per_step"] > 0 and p["top_kernels"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| capsnet | bf16+compile | 32 |" in table and "| capsnet | bf16+triton+cl+bench | 32 |" in table
    assert "Smoke run" in table and "## Profile of the training step" in table and "| routing |" in table
    routing = {r["command"].split()[1]: r for r in report["routing"]}
    assert set(routing) == {"benchmarks/bench_routing_algos.py", "benchmarks/bench_em.py"}
    assert all(r["exit_code"] == 0 for r in routing.values())
    assert any("| self-routing |" in line for line in routing["benchmarks/bench_routing_algos.py"]["output"])
    assert any("speed-up" in line for line in routing["benchmarks/bench_em.py"]["output"])
    assert "`python benchmarks/bench_em.py --device cpu --layer caps2" in table


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so():
    bad = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--variants", "bf16+turbo"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "variant 'bf16+turbo'" in bad.stderr.strip().splitlines()[-1]
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True, timeout=120)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: no CUDA GPU here")


@pytest.mark.slow
def test_gpu_session_script_without_a_gpu_logs_and_stops(tmp_path):
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    script = SCRIPT.with_name("gpu_session.sh")
    r = subprocess.run(["bash", str(script), str(tmp_path / "s")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    log = (tmp_path / "s" / "session.log").read_text()
    assert r.returncode == 2 and "error: no CUDA GPU here" in log and "gpu_check exit status: 2" in log
    assert f"torch {torch.__version__}" in log
