"""evaluate, visualize and predict default to the data a checkpoint was trained on, as its run's config.json (or a
shipped card) records it; an explicit --dataset / --data-dir wins."""

import json
from pathlib import Path

import pytest
from helpers import small_config, write_digits

from capsnet import CapsNet
from capsnet.cli import main
from capsnet.training.checkpoint_data import recorded_data

N_TEST, N_OTHER = 24, 10


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """A data set of N_TEST digits: not the bundled sample."""
    return write_digits(tmp_path_factory.mktemp("data") / "digits", N_TEST)


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """Another one, of N_OTHER digits."""
    return write_digits(tmp_path_factory.mktemp("data") / "other", N_OTHER, offset=100)


def _run(root: Path, name: str, **train) -> Path:
    """A run folder as `capsnet train` leaves it: config.json (its "train" section) and best/."""
    run = root / name
    CapsNet(config=small_config()).save_pretrained(run / "best")
    record = {"dataset": "mnist-sample", "data_dir": None, "val_fraction": 0.1, "test_fraction": 0.2, **train}
    (run / "config.json").write_text(json.dumps({"train": record, "model": {}}))
    return run


def _evaluate(capsys, *argv) -> dict:
    assert main(["evaluate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_evaluate_scores_the_data_the_run_trained_on(tmp_path, digits, other, capsys):
    run = _run(tmp_path, "run", dataset=str(digits))
    for checkpoint in (run, run / "best"):
        r = _evaluate(capsys, "--checkpoint", str(checkpoint))
        assert r["n"] == N_TEST and r["dataset"] == "digits"
    r = _evaluate(capsys, "--checkpoint", str(run), "--dataset", str(other))  # the flag wins
    assert r["n"] == N_OTHER and r["dataset"] == "other"


def test_a_recorded_data_dir_is_used_and_named_as_the_run_named_it(tmp_path, digits, capsys):
    run = _run(tmp_path, "run", dataset="mnist", data_dir=str(digits))
    assert recorded_data(run) == {
        "dataset": "mnist",
        "data_dir": str(digits),
        "test_fraction": 0.2,
        "test_subset": None,
    }
    r = _evaluate(capsys, "--checkpoint", str(run))
    assert r["n"] == N_TEST and r["dataset"] == "mnist"
    r = _evaluate(capsys, "--checkpoint", str(_run(tmp_path, "other")), "--data-dir", str(digits))
    assert r["n"] == N_TEST


def test_a_folder_that_records_no_data_needs_dataset(tmp_path, other, capsys):
    CapsNet(config=small_config()).save_pretrained(tmp_path / "m")
    assert recorded_data(tmp_path / "m") is None
    assert main(["evaluate", "--checkpoint", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no training data" in err[0] and "pass --dataset" in err[0]
    assert _evaluate(capsys, "--checkpoint", str(tmp_path / "m"), "--dataset", str(other))["n"] == N_OTHER


def test_an_ensemble_of_runs_on_different_data_needs_dataset(tmp_path, digits, capsys):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b", dataset=str(digits))
    assert main(["evaluate", "--checkpoint", str(a), "--checkpoint", str(b)]) == 2
    assert "trained on different data" in capsys.readouterr().err
    assert _evaluate(capsys, "--checkpoint", str(b), "--checkpoint", str(b))["n"] == N_TEST


@pytest.mark.slow
def test_visualize_draws_from_the_recorded_data(tmp_path, digits, other, monkeypatch):
    pytest.importorskip("matplotlib")
    from capsnet.viz import figures

    seen = []
    real = figures.confusion_matrix
    monkeypatch.setattr(figures, "confusion_matrix", lambda model, split, **kw: seen.append(len(split)) or
                        real(model, split, **kw))  # fmt: skip
    run = _run(tmp_path, "run", dataset=str(digits))
    assert main(["visualize", "--checkpoint", str(run), "--out", str(tmp_path / "fig"), "--n", "2"]) == 0
    assert main(["visualize", "--checkpoint", str(run), "--out", str(tmp_path / "fig"), "--n", "2",
                 "--dataset", str(other)]) == 0  # fmt: skip
    assert seen == [N_TEST, N_OTHER]
