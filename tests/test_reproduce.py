import json

import pytest
import torch
from helpers import SMALL_MODEL

from capsnet import load_pretrained
from capsnet.cli import main
from capsnet.data import load_dataset
from capsnet.errors import ConfigError
from capsnet.experiments.affnist import ExpandedMNISTTask, affine_test_set
from capsnet.experiments.multimnist import MultiMNISTTask
from capsnet.experiments.reproduce import EXPERIMENTS, PAPER, Setting, format_table, run_experiment, setting_for
from capsnet.training.checkpoint import read_summary
from capsnet.training.classification import subset
from capsnet.training.distributed import DistInfo
from capsnet.training.evaluator import evaluate

CPU = torch.device("cpu")

TINY_BASELINE = dict(channels=(8, 8, 4), hidden=(32, 16))


def _tiny(**kw) -> Setting:
    base = dict(
        dataset="mnist-sample",
        epochs=1,
        batch_size=32,
        train_subset=48,
        test_subset=24,
        pairs_per_digit=1,
        capsnet=dict(SMALL_MODEL),
        baseline=dict(TINY_BASELINE),
        note="tiny",
    )
    return Setting(**{**base, **kw})


@pytest.mark.slow
def test_multimnist_end_to_end(tmp_path):
    report = run_experiment("multimnist", out=str(tmp_path), device="cpu", progress=False, setting=_tiny())
    saved = json.loads((tmp_path / "multimnist" / "results.json").read_text())
    assert saved["rows"] == report["rows"]
    assert [(r["model"], r["metric"]) for r in report["rows"]] == [
        ("capsnet", "MultiMNIST test error (%)"),
        ("baseline", "MultiMNIST test error (%)"),
    ]
    assert [r["paper"] for r in report["rows"]] == [5.2, 8.1]
    # "ours" is the error of the checkpoint chosen on validation: evaluating its saved best/ on the same test pairs
    # gives it again
    data = load_dataset("mnist-sample")
    task = MultiMNISTTask(train=subset(data.train, 48), test=subset(data.test, 24), pairs_per_digit=1, seed=0)
    for row in report["rows"]:
        run = tmp_path / "multimnist" / row["model"]
        measured = task.evaluate(load_pretrained(run / "best"), batch_size=50, device=CPU, dist=DistInfo())
        assert measured["n"] == 24
        assert row["ours"] == pytest.approx(100 * (1 - measured["accuracy"]), abs=1e-4), row
        tested = json.loads((run / "test.json").read_text())["best"]
        assert row["ours"] == pytest.approx(100 * (1 - tested["accuracy"]), abs=1e-4)
        assert measured["loss"] == pytest.approx(tested["loss"], rel=1e-5)  # the same model, not a lookalike
        assert read_summary(run)[-1]["val_acc"] >= 0  # chosen on validation pairs (of held-out training digits)
    config = json.loads((tmp_path / "multimnist" / "capsnet" / "config.json").read_text())
    assert config["task"] == "multimnist" and config["model"]["image_size"] == 36
    assert "MultiMNIST" in format_table(report)


@pytest.mark.slow
def test_affnist_end_to_end_reports_both_test_sets(tmp_path):
    report = run_experiment(
        "affnist", out=str(tmp_path), device="auto", progress=False, setting=_tiny(train_subset=32, test_subset=16)
    )
    metrics = [(r["model"], r["metric"]) for r in report["rows"]]
    assert ("capsnet", "affNIST test accuracy (%)") in metrics
    assert ("baseline", "expanded MNIST test accuracy (%)") in metrics
    assert len(report["rows"]) == 4
    assert all(r["paper"] == PAPER["affnist"][(r["metric"], r["model"])] for r in report["rows"])
    # both figures are the validation-chosen model's accuracy on the two test sets, recomputed from its saved best/
    data = load_dataset("mnist-sample")
    test = subset(data.test, 16)
    task = ExpandedMNISTTask(train=subset(data.train, 32), test=test, seed=0)
    for row in report["rows"]:
        model = load_pretrained(tmp_path / "affnist" / row["model"] / "best")
        if row["metric"].startswith("affNIST"):
            measured = evaluate(model, affine_test_set(test, seed=0), batch_size=50, device=CPU)
        else:
            measured = task.evaluate(model, batch_size=50, device=CPU, dist=DistInfo())
            tested = json.loads((tmp_path / "affnist" / row["model"] / "test.json").read_text())["best"]
            assert measured["loss"] == pytest.approx(tested["loss"], rel=1e-5)
        assert measured["n"] == 16
        assert row["ours"] == pytest.approx(100 * measured["accuracy"], abs=1e-4), row


def test_quick_help_says_what_quick_does(capsys):
    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in EXPERIMENTS:
        quick = setting_for(name, quick=True)
        assert f"{name} {quick.epochs}" in text and quick.train_subset is None  # every training digit
    assert f"batch {setting_for('mnist', quick=True).batch_size}" in text
    assert f"{setting_for('multimnist', quick=True).pairs_per_digit} MultiMNIST pairs" in text


def test_settings_and_bad_input(capsys):
    assert setting_for("mnist", quick=False).dataset == "mnist"
    quick = setting_for("multimnist", quick=True)
    assert quick.dataset == "mnist-sample" and "QUICK" in quick.note
    with pytest.raises(ConfigError):
        setting_for("cifar", quick=True)
    assert main(["reproduce", "cifar", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown experiment" in err[0]
    assert main(["reproduce", "mnist", "--quick", "--dataset", "/no/such/folder"]) == 2
