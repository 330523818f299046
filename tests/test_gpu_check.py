"""benchmarks/gpu_check.py end to end, in its CPU dry-run mode (the real check needs a CUDA GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_gpu_check_smoke_run_writes_its_report(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--skip-tests", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    runs = {(e["loop"], e["variant"]) for e in report["epochs"]}
    assert runs == {("labml", "fp32"), ("capsnet", "fp32"), ("capsnet", "bf16"), ("capsnet", "bf16+compile")}
    assert all(e["images_per_s"] > 0 and e["batch"] == 32 for e in report["epochs"])
    assert len(report["accuracy"]["val_acc"]) == 1 and report["smoke"]
    assert report["accuracy"]["test"]["best"]["epoch"] == 1
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| capsnet | bf16+compile | 32 |" in table and "Smoke run" in table
    routing = {r["command"].split()[1]: r for r in report["routing"]}
    assert set(routing) == {"benchmarks/bench_routing_algos.py", "benchmarks/bench_em.py"}
    assert all(r["exit_code"] == 0 for r in routing.values())
    assert any("| self-routing |" in line for line in routing["benchmarks/bench_routing_algos.py"]["output"])
    assert any("speed-up" in line for line in routing["benchmarks/bench_em.py"]["output"])
    assert "`python benchmarks/bench_em.py --device cpu --layer caps2" in table


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so():
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True, timeout=120)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: no CUDA GPU here")
