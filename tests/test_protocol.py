"""The evaluation protocol: a stratified, seeded validation split held out of the training images; best/ chosen on
it; the test split read once, at the end, for best/ and last/; and a checkpoint set that is consistent after a kill
at any write."""

import json
import math
import os

import numpy as np
import pytest
import torch
from helpers import small_config
from safetensors.torch import load_file

from capsnet import load_pretrained
from capsnet.cli import main
from capsnet.data import Split, load_dataset
from capsnet.data.split import holdout_counts, stratified_holdout
from capsnet.errors import ConfigError, DatasetError
from capsnet.training import classification, evaluator, runfolder
from capsnet.training.api import train
from capsnet.training.build import build
from capsnet.training.checkpoint import TEST_NAME, checkpoint_info, load_state, read_summary
from capsnet.training.classification import ClassificationTask
from capsnet.training.config import TrainConfig
from capsnet.training.state import restore

TINY = dict(train_subset=60, test_subset=30, batch_size=20, epochs=2, progress=False, tensorboard=False)
TINY_MODEL = dict(conv_channels=8, primary_types=2)


def _config(tmp_path, name="run", **kw) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / name), **{**TINY, **kw})


# ------------------------------------------------------------------------------------------------ the split
def test_holdout_counts_are_proportional_and_never_take_a_whole_class():
    counts = holdout_counts(np.array([605, 690, 555, 615, 588, 529, 594, 658, 588, 578]), 0.1)
    assert counts.sum() == 600 and counts.tolist() == [61, 69, 55, 61, 59, 53, 59, 66, 59, 58]  # largest remainders
    assert holdout_counts(np.array([1, 9]), 0.5).tolist() == [0, 5]  # a class of one stays in training
    assert holdout_counts(np.array([3, 3, 3]), 0.01).sum() == 1  # at least one example


def test_stratified_holdout_is_seeded_disjoint_and_covers_the_split():
    labels = torch.arange(100) % 4
    split = Split(torch.arange(100, dtype=torch.uint8).view(100, 1, 1, 1), labels)
    kept, held = stratified_holdout(split, 0.2, seed=3)
    assert len(kept) == 80 and held.labels.bincount().tolist() == [5, 5, 5, 5]
    ids = torch.cat([kept.images.flatten(), held.images.flatten()]).sort().values
    assert torch.equal(ids, torch.arange(100, dtype=torch.uint8))  # disjoint, nothing lost
    assert (held.images.flatten().diff() > 0).all()  # the original order is kept
    again = stratified_holdout(split, 0.2, seed=3)[1]
    other = stratified_holdout(split, 0.2, seed=4)[1]
    assert torch.equal(again.images, held.images) and not torch.equal(other.images, held.images)
    with pytest.raises(DatasetError, match=r"in \(0, 1\)"):
        stratified_holdout(split, 1.0, seed=0)


def test_the_sample_splits_5400_600_and_the_split_does_not_follow_the_training_seed():
    train = load_dataset("mnist-sample").train
    a = classification.validation_split(train, None, TrainConfig(seed=0))
    b = classification.validation_split(train, None, TrainConfig(seed=5))
    assert (len(a[0]), len(a[1])) == (5400, 600) and torch.equal(a[1].images, b[1].images)
    assert a[2] == {"source": "held out of the training split", "fraction": 0.1, "seed": 0, "n": 600}
    assert classification.validation_split(train, None, TrainConfig(val_fraction=0))[1] is None
    with pytest.raises(ConfigError, match="val_fraction"):
        TrainConfig(val_fraction=1.0)


# ------------------------------------------------------------------------------------------------ the run
def test_best_follows_validation_and_the_test_split_is_read_once_at_the_end(tmp_path, monkeypatch):
    reads = []
    evaluate = classification.ClassificationTask.evaluate

    def counting(self, model, *, split="test", **kw):
        reads.append(split)
        return evaluate(self, model, split=split, **kw)

    monkeypatch.setattr(classification.ClassificationTask, "evaluate", counting)
    result = train(_config(tmp_path, epochs=3), small_config(**TINY_MODEL))
    assert reads == ["val", "val", "val", "test", "test"]  # one val per epoch; test twice (last/, best/) at the end
    rows = read_summary(tmp_path / "run")
    assert all(0 <= r["val_acc"] <= 1 and math.isnan(r["test_acc"]) for r in rows)
    best_epoch = min(result.history, key=lambda r: (r["val_loss"], r["epoch"]))["epoch"]  # the default monitor's
    info = checkpoint_info(tmp_path / "run" / "best")
    assert info["epoch"] == best_epoch == result.best["epoch"] and info["selected_on"] == "val_loss"
    assert info["value"] == pytest.approx(rows[int(best_epoch) - 1]["val_loss"], rel=1e-5)
    report = json.loads((tmp_path / "run" / TEST_NAME).read_text())
    assert report == result.test and report["selected_on"] == "val_loss" and "note" not in report
    assert report["best"]["epoch"] == best_epoch and report["last"]["epoch"] == 3 and report["best"]["n"] == 30
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["validation"] == {"source": "held out of the training split", "fraction": 0.1, "seed": 0, "n": 6}
    # best/'s test figure is its own: the saved folder scores it again
    model = load_pretrained(tmp_path / "run" / "best")
    test = load_dataset("mnist-sample").test
    again = evaluator.evaluate(model, Split(test.images[:30], test.labels[:30]))
    assert again["accuracy"] == pytest.approx(report["best"]["accuracy"])


def test_val_fraction_zero_warns_and_chooses_on_the_test_set(tmp_path, capsys):
    result = train(_config(tmp_path, val_fraction=0.0, epochs=1), small_config(**TINY_MODEL))
    err = capsys.readouterr().err
    assert err.count("best/ is chosen on the test set") == 1
    assert result.best["metric"] == "test_loss" and "maximum over epochs" in result.test["note"]
    assert not math.isnan(read_summary(tmp_path / "run")[0]["test_acc"])


def test_evaluate_says_which_checkpoint_it_scored_and_how_it_was_chosen(tmp_path, capsys):
    train(_config(tmp_path, epochs=1), small_config(**TINY_MODEL))
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(line for line in lines if not line.startswith("data: "))  # (after the data's conversions, if any)
    assert first.startswith("scored ") and "best (epoch 1, chosen on validation loss" in first
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run" / "last")]) == 0
    assert "(epoch 1, the run's last checkpoint)" in capsys.readouterr().out


def test_resume_drops_the_loaded_state_and_refuses_other_data(tmp_path):
    train(_config(tmp_path, epochs=1), small_config(**TINY_MODEL))
    run = build(_config(tmp_path, epochs=2, resume=True), None, torch.device("cpu"), _dist(), None)
    assert run.state_dict is not None and run.state_dict["model"]["conv1.weight"].device.type == "cpu"
    restore(run)
    assert run.state_dict is None  # the weights and Adam moments are not kept a second time
    runfolder.release(run.dir)  # (the loop's launch() lets go of the folder; this run was only built)
    other = ClassificationTask.from_config(_config(tmp_path, train_subset=120))
    with pytest.raises(ConfigError, match="was validated on 6 images, this data gives 12 images"):
        train(_config(tmp_path, epochs=2, resume=True), small_config(**TINY_MODEL), task=other)


def _dist():
    from capsnet.training.distributed import DistInfo

    return DistInfo()


# ------------------------------------------------------------------------------------------------ kills
class Killed(BaseException):
    """A kill at a write: raised before an atomic replace, which then never happens (the old file stays)."""


def _outcome(run_dir):
    """What a finished run leaves: weights of last/ and best/, summary rows (without timings), test.json."""
    rows = [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")} for r in read_summary(run_dir)]
    weights = {v: load_file(str(run_dir / v / "model.safetensors")) for v in ("last", "best")}
    return weights, rows, json.loads((run_dir / TEST_NAME).read_text())


@pytest.mark.slow
def test_a_kill_at_any_write_leaves_a_set_that_resumes_to_the_same_run(tmp_path, monkeypatch):
    """Kill the run at each atomic replace in turn (each file of every checkpoint, config.json, test.json); each
    time, every folder left is whole, and --resume (or a fresh start, when no state.pt was committed) ends in the
    same weights, summary and test figures as the run that was never killed (CPU training is deterministic)."""
    config = dict(epochs=2, train_subset=40, test_subset=20, batch_size=20)
    replace, calls = os.replace, []

    def counting(src, dst):
        calls.append(str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", counting)
    train(_config(tmp_path, "whole", **config), small_config(**TINY_MODEL))
    monkeypatch.setattr(os, "replace", replace)
    want = _outcome(tmp_path / "whole")
    assert any(c.endswith("state.pt") for c in calls) and len(calls) >= 10
    for k in range(len(calls)):
        name = f"killed-{k}"
        count = iter(range(k + 1))

        def kill_at_k(src, dst, count=count, k=k):
            if next(count, None) == k:  # a real kill leaves the temporary file: keep a link to it
                os.link(src, os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.killed.tmp"))
                raise Killed(dst)
            replace(src, dst)

        monkeypatch.setattr(os, "replace", kill_at_k)
        with pytest.raises(Killed):
            train(_config(tmp_path, name, **config), small_config(**TINY_MODEL))
        monkeypatch.setattr(os, "replace", replace)
        run_dir = tmp_path / name
        for view in ("last", "best"):  # whatever is there is a whole save_pretrained folder
            if (run_dir / view / "config.json").is_file():
                load_pretrained(run_dir / view)
        has_state = (run_dir / "state.pt").is_file()
        if has_state:
            load_state(run_dir)
        train(_config(tmp_path, name, resume=has_state, **config), small_config(**TINY_MODEL))
        weights, rows, report = _outcome(run_dir)
        assert rows == want[1] and report == want[2], (k, calls[k])
        for view in ("last", "best"):
            assert all(torch.equal(weights[view][n], want[0][view][n]) for n in want[0][view]), (k, view)
        assert not list(run_dir.glob("**/.*.tmp"))  # no temporary file is left behind
