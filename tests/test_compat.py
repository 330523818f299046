"""A run folder written by capsnet 0.1.0 (tests/fixtures/run-0.1.0: `digit_dim` in config.json, `digits.weight` in the
weights) still loads, evaluates and resumes; the old names are read with a DeprecationWarning naming the new ones."""

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from capsnet import CapsNet, CapsNetConfig, ConfigError, load_pretrained
from capsnet.cli import main
from capsnet.config import from_dict
from capsnet.data import Split, load_dataset
from capsnet.training.api import train
from capsnet.training.checkpoint import read_summary
from capsnet.training.config import TrainConfig
from capsnet.training.evaluator import evaluate

FIXTURE = Path(__file__).parent / "fixtures" / "run-0.1.0"


def test_fixture_is_written_with_the_old_names():
    # Guards the tests below: they exercise the renaming only while the fixture holds the old keys.
    assert "digit_dim" in json.loads((FIXTURE / "best" / "config.json").read_text())["config"]
    state = torch.load(FIXTURE / "state.pt", weights_only=True)
    assert "digits.weight" in state["model"] and "digit_dim" in state["model_config"]


def test_load_pretrained_maps_old_names_with_a_warning():
    with pytest.warns(DeprecationWarning) as record:
        model = load_pretrained(FIXTURE / "best")
    messages = [str(w.message) for w in record]
    assert any("'digit_dim' is deprecated, use 'class_dim'" in m for m in messages), messages
    assert any("'digits.*' are deprecated, now 'class_caps.*'" in m for m in messages), messages
    assert isinstance(model, CapsNet) and model.config.class_dim == 4
    assert model.class_caps.weight.shape == (2 * 6 * 6, 10, 4, 4)
    # The weights landed where they belong: the run's own epoch-2 test figures (first 50 test digits) come back.
    test = load_dataset("mnist-sample").test
    row = read_summary(FIXTURE)[1]
    metrics = evaluate(model, Split(test.images[:50], test.labels[:50]))
    assert metrics["accuracy"] == pytest.approx(row["test_acc"], abs=1e-9)
    assert metrics["loss"] == pytest.approx(row["test_loss"], rel=1e-5)


def test_old_state_dict_keys_load_with_a_warning():
    model = CapsNet(config=CapsNetConfig(conv_channels=8, primary_types=2, primary_dim=4, class_dim=4))
    old = {
        ("digits." + k[len("class_caps.") :] if k.startswith("class_caps.") else k): v.clone() + 1
        for k, v in model.state_dict().items()
    }
    assert "digits.weight" in old
    with pytest.warns(DeprecationWarning, match="class_caps"):
        model.load_state_dict(old)
    assert torch.equal(model.class_caps.weight, old["digits.weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's names load silently
        model.load_state_dict(model.state_dict())


def test_old_config_key_renaming_rules():
    with pytest.warns(DeprecationWarning, match="use 'class_dim'"):
        assert from_dict(CapsNetConfig, {"digit_dim": 7}).class_dim == 7
    with pytest.raises(ConfigError, match="both 'digit_dim' and its new name 'class_dim'"):
        from_dict(CapsNetConfig, {"digit_dim": 7, "class_dim": 8})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_dict(CapsNetConfig, {"class_dim": 8}).class_dim == 8


def test_capsnet_evaluate_on_the_old_run(capsys):
    with pytest.warns(DeprecationWarning):
        assert main(["evaluate", "--checkpoint", str(FIXTURE), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    n = json.loads((FIXTURE / "config.json").read_text())["train"]["test_subset"]  # the subset its test.json scored
    assert result["n"] == n == 50 and 0.0 <= result["accuracy"] <= 1.0
    test = load_dataset("mnist-sample").test
    with pytest.warns(DeprecationWarning):
        expected = evaluate(load_pretrained(FIXTURE / "best"), Split(test.images[:n], test.labels[:n]))
    assert result["accuracy"] == pytest.approx(expected["accuracy"]) and result["confusion"] == expected["confusion"]


def test_resume_the_old_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    config = TrainConfig(
        out=str(run),
        resume=True,
        epochs=3,
        train_subset=64,
        test_subset=50,
        batch_size=16,
        progress=False,
        tensorboard=False,
    )
    with pytest.warns(DeprecationWarning) as record:
        result = train(config)
    assert any("class_dim" in str(w.message) for w in record) and any("class_caps" in str(w.message) for w in record)
    assert not result.interrupted and result.epochs_done == 3
    old_rows, rows = read_summary(FIXTURE), read_summary(run)
    assert [r["epoch"] for r in rows] == [1.0, 2.0, 3.0]
    assert [{k: r[k] for k in old_rows[0]} for r in rows[:2]] == old_rows  # the two old epochs are kept as they were
    assert all(math.isnan(r["val_acc"]) for r in rows)  # the run keeps choosing best/ on the test set, as it did
    new_row = [v for k, v in rows[2].items() if not k.startswith("val_")]
    assert all(torch.isfinite(torch.tensor(new_row))) and 0.0 <= rows[2]["test_acc"] <= 1.0
    # What the resumed run writes uses today's names only.
    meta = json.loads((run / "config.json").read_text())
    assert meta["model"]["class_dim"] == 4 and "digit_dim" not in meta["model"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_pretrained(run / "last")
    assert model.config.class_dim == 4
    state = torch.load(run / "state.pt", weights_only=True)
    assert "class_caps.weight" in state["model"] and state["epoch"] == 3
