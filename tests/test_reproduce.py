import json

import pytest
from helpers import SMALL_MODEL

from capsnet.cli import main
from capsnet.errors import ConfigError
from capsnet.experiments.reproduce import PAPER, Setting, format_table, run_experiment, setting_for

TINY_BASELINE = dict(channels=(8, 8, 4), hidden=(32, 16))


def _tiny(**kw) -> Setting:
    base = dict(dataset="mnist-sample", epochs=1, batch_size=32, train_subset=48, test_subset=24,
                pairs_per_digit=1, capsnet=dict(SMALL_MODEL), baseline=dict(TINY_BASELINE), note="tiny")  # fmt: skip
    return Setting(**{**base, **kw})


def test_multimnist_end_to_end(tmp_path):
    report = run_experiment("multimnist", out=str(tmp_path), device="cpu", progress=False, setting=_tiny())
    saved = json.loads((tmp_path / "multimnist" / "results.json").read_text())
    assert saved["rows"] == report["rows"]
    assert [(r["model"], r["metric"]) for r in report["rows"]] == [
        ("capsnet", "MultiMNIST test error (%)"), ("baseline", "MultiMNIST test error (%)")]  # fmt: skip
    assert [r["paper"] for r in report["rows"]] == [5.2, 8.1]
    for r in report["rows"]:
        assert 0 <= r["ours"] <= 100
    config = json.loads((tmp_path / "multimnist" / "capsnet" / "config.json").read_text())
    assert config["task"] == "multimnist" and config["model"]["image_size"] == 36
    assert "MultiMNIST" in format_table(report)


def test_affnist_end_to_end_reports_both_test_sets(tmp_path):
    report = run_experiment("affnist", out=str(tmp_path), device="auto", progress=False,
                            setting=_tiny(train_subset=32, test_subset=16))  # fmt: skip
    metrics = [(r["model"], r["metric"]) for r in report["rows"]]
    assert ("capsnet", "affNIST test accuracy (%)") in metrics
    assert ("baseline", "expanded MNIST test accuracy (%)") in metrics
    assert len(report["rows"]) == 4
    assert all(r["paper"] == PAPER["affnist"][(r["metric"], r["model"])] for r in report["rows"])


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
