"""benchmarks/bench_routing_algos.py and benchmarks/compare_routing.py: they run, cover every algorithm and model,
and the routing benchmark's module/transcription results agree."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet
from capsnet.models.inverted_attention_capsnet import InvertedAttentionCapsNet
from capsnet.models.registry import MODELS

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_routing_benchmark_runs_and_results_agree():
    r = subprocess.run([sys.executable, str(BENCH / "bench_routing_algos.py"), "--batch-size", "2", "--repeats", "1",
                        "--threads", "1"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr  # exit status 1 if any output or gradient differs
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "×" in line and "img/s" not in line]
    assert {row.split("|")[1].split()[0] for row in rows} == {"dynamic", "self-attention", "inverted-attention",
                                                               "self-routing"}  # fmt: skip


@pytest.mark.parametrize("device,message", [("foo", "expected cpu, cuda or cuda:K"), ("cuda", "no CUDA GPU here")])
def test_routing_benchmark_bad_device_is_one_line_and_exit_2(device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, str(BENCH / "bench_routing_algos.py"), "--device", device],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stdout == "" and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("paper_fn,make", [
    ("self_attention_paper", lambda m: m.SelfAttentionRouter(6, 3, 4, 5)),
    ("inverted_attention_paper", lambda m: m.InvertedAttentionFC(6, 3, 4, 5, 3)),
])  # fmt: skip
def test_routing_benchmark_transcriptions_equal_the_modules(paper_fn, make):
    bench = _load("bench_routing_algos")
    layer = make(bench)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.3)
    u = torch.randn(3, 6, 4)
    assert torch.allclose(getattr(bench, paper_fn)(layer, u), layer(u), atol=1e-5)


def test_compare_routing_covers_every_model_and_routing():
    compare = _load("compare_routing")
    entries = compare.entries()
    assert {model for model, _ in entries.values()} == set(MODELS)
    assert {o["routing"] for m, o in entries.values() if m == "capsnet"} == set(compare.ROUTINGS)


def test_compare_routing_sets_iterations_where_routing_iterates():
    compare = _load("compare_routing")
    dynamic = CapsNet(config=small_config())
    assert compare.set_iterations(dynamic, 1) and dynamic.class_caps.iterations == 1
    assert not compare.set_iterations(CapsNet(config=small_config(routing="self-routing")), 1)
    tsai = InvertedAttentionCapsNet(in_channels=1, image_size=28, primary_types=2, capsule_types=(2, 2),
                                    stem_channels=4)  # fmt: skip
    assert compare.set_iterations(tsai, 1) and tsai.config.routing_iterations == 1
    out = compare.measure(tsai.eval(), compare.Split(torch.zeros(4, 1, 28, 28, dtype=torch.uint8),
                                                     torch.tensor([0, 1, 2, 3])))  # fmt: skip
    assert 0 <= out["accuracy"] <= 1 and out["spread"] == pytest.approx(0.0, abs=1e-5)  # r = 1: uniform
