"""benchmarks/bench_routing_algos.py (it runs, covers every algorithm, and its module/transcription results agree)
and `capsnet compare` (capsnet.experiments.compare and .measure): its entries, its one-line refusals, its
measurements, and the rows of a tiny run checked against the runs they come from."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet, load_pretrained
from capsnet.cli import build_parser, main
from capsnet.configs.routings import fully_connected
from capsnet.data import Split, load_dataset
from capsnet.data.augment import affine_test_images
from capsnet.data.scaling import channel_stats
from capsnet.errors import ConfigError
from capsnet.experiments import compare, measure
from capsnet.experiments.compare import entries
from capsnet.models.baseline import BaselineCNN
from capsnet.models.recipe import model_input
from capsnet.models.registry import MODELS
from capsnet.results import read_rows

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.tooling
def test_routing_benchmark_runs_and_results_agree():
    r = subprocess.run([sys.executable, str(BENCH / "bench_routing_algos.py"), "--batch-size", "2", "--repeats", "1",
                        "--threads", "1"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr  # exit status 1 if any output or gradient differs
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "×" in line and "img/s" not in line]
    assert {row.split("|")[1].split()[0] for row in rows} == {"dynamic", "self-attention", "inverted-attention",
                                                               "self-routing"}  # fmt: skip


@pytest.mark.tooling
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


# ---------------------------------------------------------------------------------------------- capsnet compare
def test_compare_defaults_to_every_routing_and_every_other_model():
    found = entries(None, None, {})
    routings = [f"capsnet --routing {r}" for r in fully_connected()]
    assert [e.label for e in found] == routings + [m for m in MODELS if m != "capsnet"]
    assert [e.config for e in found[: len(routings)]] == [f"--routing {r}" for r in fully_connected()]
    assert all(e.config == "defaults" and e.overrides == {} for e in found[len(routings) :])


def test_compare_options_go_to_the_entries_whose_config_has_them():
    dynamic, baseline = entries(["dynamic"], ["baseline-cnn"], {"conv_channels": 16, "hidden": [8]})
    assert (dynamic.model, dynamic.overrides) == ("capsnet", {"conv_channels": 16, "routing": "dynamic"})
    assert dynamic.config == "--routing dynamic --conv-channels 16" and dynamic.folder == "routing-dynamic"
    assert (baseline.model, baseline.overrides, baseline.config) == ("baseline", {"hidden": [8]}, "--hidden 8")


@pytest.mark.parametrize("argv,message", [
    (["--routings", "nope"], "unknown routing 'nope'; known: dynamic"),
    (["--models", "nope"], "unknown model 'nope'; known: capsnet"),
    (["--routings", "3d"], "routes capsule grids"),
    (["--routings", "dynamic,dynamic"], "named twice: capsnet --routing dynamic"),
    (["--routings", "dynamic", "--option", "nope=1"], "--option nope: no compared model takes it"),
    (["--routings", "em", "--option", "class_dim=8"], "--class-dim 16"),
    (["--routings", "dynamic", "--epochs", "0"], "epochs must be >= 1"),
    (["--models", "baseline", "--infer-batch", "0"], "--infer-batch must be >= 1"),
    (["--models", "baseline", "--infer-seconds", "0"], "--infer-seconds must be > 0"),
])  # fmt: skip
def test_compare_bad_input_is_one_line_and_exit_2_before_anything_trains(tmp_path, capsys, argv, message):
    code = main(["compare", *argv, "--out", str(tmp_path / "cmp")])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and err.count("\n") == 1 and out == ""
    assert not (tmp_path / "cmp").exists()


def _digits(n: int = 8) -> Split:
    test = load_dataset("mnist-sample").test
    return Split(test.images[:n], test.labels[:n])


def test_routing_spread_is_zero_for_uniform_weights_and_grows_as_they_move():
    model = CapsNet(config=small_config(routing="self-routing")).eval()  # W^route = 0: c_ij = 1/10
    cpu = torch.device("cpu")
    assert measure.routing_spread(model, _digits(), cpu) == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        model.class_caps.route_bias.normal_(std=3.0)  # b^route_i: each child prefers some parents
    assert measure.routing_spread(model, _digits(), cpu) > 0.5
    assert measure.routing_spread(BaselineCNN(channels=(4,), hidden=(8,)), _digits(), cpu) is None  # no routing


def test_the_affine_test_images_are_seeded_moved_and_keep_labels_and_statistics():
    digits = _digits()
    split = Split(digits.images, digits.labels, channel_stats(digits))
    moved, again = measure.affine_split(split), measure.affine_split(split)
    assert moved.images.dtype == torch.uint8 and torch.equal(moved.images, again.images)
    assert (moved.images != split.images).float().mean() > 0.05 and torch.equal(moved.labels, split.labels)
    assert moved.channel_stats == split.channel_stats


def test_the_inference_timing_options_reach_each_entrys_measurement(tmp_path, monkeypatch, capsys):
    seen = []

    def record(entry, seed, **settings):
        seen.append(settings)
        raise ConfigError("recorded")  # (nothing trains: the entry fails, and compare says so)

    monkeypatch.setattr(compare, "run_entry", record)
    argv = ["compare", "--models", "baseline", "--infer-batch", "4", "--infer-seconds", "0.25"]
    assert main([*argv, "--out", str(tmp_path / "cmp")]) == 1
    assert [(s["infer_batch"], s["infer_seconds"]) for s in seen] == [(4, 0.25)]
    assert "recorded" in capsys.readouterr().err
    defaults = build_parser(["compare"]).parse_args(["compare"])  # the flags' defaults are the measurement's
    assert (defaults.infer_batch, defaults.infer_seconds) == (measure.INFER_BATCH, measure.INFER_SECONDS)


def test_inference_speed_counts_images_per_second():
    model = CapsNet(config=small_config()).eval()
    slow = measure.inference_speed(model, _digits(), 4, torch.device("cpu"), seconds=0.05)
    assert 0 < slow < 1e6


@pytest.mark.slow
def test_a_tiny_compare_writes_rows_that_agree_with_its_runs(tmp_path, capsys):
    out = tmp_path / "cmp"
    options = ["conv_channels=16", "primary_types=4", "primary_dim=4", "class_dim=6", "decoder_hidden=[32,64]",
               "channels=[8,8]", "hidden=[32,16]"]  # fmt: skip
    argv = ["compare", "--routings", "dynamic,self-routing", "--models", "baseline", "--epochs", "1",
            "--train-subset", "48", "--test-subset", "24", "--batch-size", "16", "--device", "cpu",
            "--out", str(out), "--infer-batch", "8", "--infer-seconds", "0.05",
            *(a for o in options for a in ("--option", o))]  # fmt: skip
    assert main(argv) == 0
    rows = {r.config.split()[1] if r.model == "capsnet" else r.model: r for r in read_rows(out / "results.csv")}
    assert set(rows) == {"dynamic", "self-routing", "baseline"}
    assert rows["dynamic"].config == "--routing dynamic --conv-channels 16 --primary-types 4 --primary-dim 4 " \
                                     "--class-dim 6 --decoder-hidden 32 64"  # fmt: skip
    assert rows["baseline"].config == "--channels 8 8 --hidden 32 16"
    test = _digits(24)
    for entry, row in rows.items():
        folder = out / (f"model-{entry}" if entry == "baseline" else f"routing-{entry}") / "seed-0"
        scored = json.loads((folder / "test.json").read_text(encoding="utf-8"))
        assert row.protocol == "best/ on val_loss, test scored once" and scored["selected_on"] == "val_loss"
        assert row.test_acc_mean == pytest.approx(100 * scored["best"]["accuracy"], abs=1e-3)
        assert (row.seeds, row.test_acc_std, row.epochs, row.batch_size, row.test_images) == ("0", 0, 1, 16, 24)
        assert row.train_images + row.val_images == 48 and row.val_images > 0
        model = load_pretrained(folder / "best")
        assert row.params == sum(p.numel() for p in model.parameters() if p.requires_grad)
        # the affine accuracy, again: the results data's transform, the model's recipe, its predictions
        x = model_input(model, affine_test_images(test.images))
        with torch.no_grad():
            correct = (model(x).predictions == test.labels).float().mean().item()
        assert row.affine_acc_mean == pytest.approx(100 * correct, abs=1e-3)
        assert row.train_img_s > 0 and row.infer_img_s_b1 > 0 and row.infer_img_s_batch > 0 and row.infer_batch == 8
        assert row.peak_mem_mb > 100 and row.command.startswith("capsnet compare") and row.status == "done"
        assert (row.routing_spread is None) == (row.model == "baseline")
    table = (out / "compare.md").read_text(encoding="utf-8")
    assert all(f"| {label} |" in table for label in ("capsnet --routing dynamic", "capsnet --routing self-routing",
                                                     "baseline"))  # fmt: skip
