"""`capsnet reproduce zoo`: seeds trained once, rows that match their runs, finished work skipped, bad input refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from capsnet.cli import main
from capsnet.data.augment import AFFINE_TEST, affine_test_images
from capsnet.errors import CapsNetError
from capsnet.experiments import zoo
from capsnet.results import Row, read_rows, rows_csv, write_rows


@pytest.fixture
def tiny_zoo(monkeypatch):
    """The sample benchmark cut to 1 epoch on 64 training and 50 test digits."""
    monkeypatch.setitem(zoo.SAMPLE_EPOCHS, "efficient-capsnet", 1)
    real = zoo.ZooPlan.train_config

    def small(self, model, seed):
        return dataclasses.replace(real(self, model, seed), train_subset=64, test_subset=50)

    monkeypatch.setattr(zoo.ZooPlan, "train_config", small)


@pytest.mark.slow
def test_a_model_row_holds_every_seed_of_its_runs_and_is_not_trained_again(tmp_path, tiny_zoo, monkeypatch):
    plan = zoo.ZooPlan(benchmark="sample", models=["efficient-capsnet"], seeds=[0, 1], out=tmp_path / "runs",
                       results=tmp_path / "results", precision="fp32", progress=False)  # fmt: skip
    (row,) = zoo.run_zoo(plan)
    tests = [json.loads((plan.run_dir("efficient-capsnet", s) / "test.json").read_text()) for s in (0, 1)]
    assert row.test_acc == " ".join(f"{100 * t['best']['accuracy']:.2f}" for t in tests)
    assert row.seeds == "0 1" and row.epochs == 1 and row.precision == "fp32" and row.test_images == 50
    assert row.val_images == 6 and row.train_images == 58  # a stratified tenth of the 64 held out
    affine = [json.loads((plan.run_dir("efficient-capsnet", s) / "affine.json").read_text()) for s in (0, 1)]
    assert [a["n"] for a in affine] == [50, 50]  # the run's own test images, transformed
    assert row.affine_acc_mean == pytest.approx(50 * (affine[0]["accuracy"] + affine[1]["accuracy"]))
    assert "--model efficient-capsnet --seeds 2" in row.command and row.params > 100_000
    assert (tmp_path / "results" / "sample.csv").read_text() == rows_csv([row])

    def no_training(*args, **kwargs):
        raise AssertionError("a model that results/ holds was trained again")

    monkeypatch.setattr(zoo, "train", no_training)
    assert zoo.run_zoo(plan) == []  # results/ holds the row: nothing to do
    (tmp_path / "results" / "sample.csv").unlink()
    (again,) = zoo.run_zoo(plan)  # the seeds are finished: the row is made from their folders
    assert again.test_acc == row.test_acc and again.affine_acc_mean == row.affine_acc_mean


def test_the_affine_test_images_are_the_same_draw_every_time():
    import torch

    images = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8)
    first, second = affine_test_images(images), affine_test_images(images)
    assert first.dtype == torch.uint8 and torch.equal(first, second) and not torch.equal(first, images)
    assert AFFINE_TEST["degrees"] == 15.0


def test_an_unknown_benchmark_or_model_is_one_error():
    with pytest.raises(CapsNetError, match="unknown benchmark 'mnist'; known: sample, fashion-mnist"):
        zoo.ZooPlan(benchmark="mnist", models=["capsnet"], seeds=[0], out=Path("x"))
    with pytest.raises(CapsNetError, match="unknown model 'nope'"):
        zoo.ZooPlan(benchmark="sample", models=["nope"], seeds=[0], out=Path("x"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--benchmark", "cifar"], "--benchmark: invalid choice: 'cifar'"),
     (["--precision", "fp16"], "--precision: invalid choice: 'fp16'"),
     (["--epochs", "3"], "--epochs: not an option of `capsnet reproduce zoo`"), (["--model", "nope"], "unknown model")],
)  # fmt: skip
def test_bad_zoo_flags_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    try:
        code = main(["reproduce", "zoo", "--out", str(tmp_path / "o"), "--results", str(tmp_path / "r"), *argv])
    except SystemExit as e:  # argparse's own refusals (an invalid choice)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def test_zoo_flags_on_another_experiment_are_refused(capsys):
    assert main(["reproduce", "mnist", "--benchmark", "sample"]) == 2
    assert "--benchmark: options of `capsnet reproduce zoo` only" in capsys.readouterr().err


CPU = "Some CPU, 2 cores, AVX2"  # the host results/cost.csv names


def _cost(results: Path, speeds: dict[str, float]) -> None:
    rows = [Row(model=m, benchmark="cost", precision="fp32", train_img_s=v, cpu=CPU) for m, v in speeds.items()]
    write_rows(results / "cost.csv", rows)


def test_full_fashion_mnist_on_a_cpu_gets_the_seeds_a_model_s_speed_allows(tmp_path):
    # one seed = 3 epochs × 54,000 images: 1 h at 45 img/s, 3 h at 15 img/s
    _cost(tmp_path, {"efficient-capsnet": 46.0, "capsnet": 44.0, "baseline": 15.1, "em-capsnet": 14.9})
    plan = zoo.ZooPlan(benchmark="fashion-mnist", models=["capsnet"], seeds=[0, 1, 2], out=tmp_path / "runs",
                       results=tmp_path, precision="fp32", device="cpu", progress=False)  # fmt: skip
    assert plan.seeds_for("efficient-capsnet") == ([0, 1, 2], "done")  # 0.98 h
    assert plan.seeds_for("capsnet") == ([0], f"1 seed: one seed ≈ 1.0 h on {CPU} (results/cost.csv)")  # 1.02 h
    assert plan.seeds_for("baseline")[0] == [0]  # 2.98 h
    assert plan.seeds_for("em-capsnet") == ([], f"not run: one seed ≈ 3.0 h on {CPU} (results/cost.csv)")  # 3.02 h
    assert plan.seeds_for("vb-capsnet") == ([0, 1, 2], "done")  # no speed measured: every seed
    assert dataclasses.replace(plan, seeds=[5]).seeds_for("baseline") == ([5], "done")  # one seed asked: one given
    sample = zoo.ZooPlan(benchmark="sample", models=["em-capsnet"], seeds=[0, 1, 2], out=tmp_path / "runs",
                         results=tmp_path, precision="fp32", device="cpu", progress=False)  # fmt: skip
    assert sample.seeds_for("em-capsnet") == ([0, 1, 2], "done")  # the sample's budgets are stated per model


def test_a_model_the_cpu_cannot_take_gets_a_not_run_row_with_the_gpu_command(tmp_path, monkeypatch, capsys):
    _cost(tmp_path, {"em-capsnet": 1.0})

    def no_training(*args, **kwargs):
        raise AssertionError("a model the CPU cannot take was trained")

    monkeypatch.setattr(zoo, "train", no_training)
    out = tmp_path / "out"
    argv = ["reproduce", "zoo", "--benchmark", "fashion-mnist", "--model", "em-capsnet", "--precision", "fp32",
            "--device", "cpu", "--out", str(out), "--results", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    gpu = "capsnet reproduce zoo --benchmark fashion-mnist --model em-capsnet --seeds 3 --precision fp32 --device cuda"
    assert (
        f"em-capsnet: not run: one seed ≈ 45.0 h on {CPU} (results/cost.csv); on a GPU: {gpu}"
        in capsys.readouterr().out
    )
    (row,) = read_rows(tmp_path / "fashion-mnist.csv")
    assert (row.status, row.command, row.epochs, row.batch_size, row.seeds, row.test_acc_mean) == (
        f"not run: one seed ≈ 45.0 h on {CPU} (results/cost.csv)",
        gpu,
        zoo.FASHION_EPOCHS,
        128,  # the GPU command's batch: em-capsnet has no recipe batch, so the CUDA default
        "",
        None,
    )
    assert row.params == 318_964 and not out.exists()  # nothing trained, no run folder
    from capsnet.results_tables import accuracy_table

    assert f"not run: one seed ≈ 45.0 h on {CPU} (results/cost.csv) | — | — | `{gpu}` |" in accuracy_table([row])
