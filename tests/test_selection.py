"""What chooses best/ (`--monitor`) and the moving average of the weights (`--ema`): the criterion's order and ties,
what test.json records, old runs resuming with their own criterion, the average's arithmetic, its buffers, and a
stopped and resumed run whose average is bit for bit the uninterrupted one's (capsnet train, capsnet.fit, torchrun)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import QUIET_FLAGS, TINY_RUN_FLAGS, small_config, write_rgb
from safetensors.torch import load_file
from torch import nn

import capsnet
from capsnet.cli import main
from capsnet.errors import ConfigError
from capsnet.training.api import train
from capsnet.training.checkpoint import load_state, read_summary
from capsnet.training.config import TrainConfig
from capsnet.training.ema import WeightAverage
from capsnet.training.selection import DEFAULT_MONITOR, Monitor

MODEL, QUIET = TINY_RUN_FLAGS, QUIET_FLAGS


@pytest.fixture(scope="module")
def rgb(tmp_path_factory) -> Path:
    """60 + 12 RGB images of 16×16 in 3 classes."""
    return write_rgb(tmp_path_factory.mktemp("data"), n_train=60)


def _train(out: Path, rgb: Path, *extra: str) -> int:
    return main(["train", "--dataset", str(rgb), "--out", str(out), "--batch-size", "8", "--val-fraction", "0.25",
                 *MODEL, *QUIET, *extra])  # fmt: skip


# ----------------------------------------------------------------------------------------------- stopping
def test_a_run_stops_after_the_epoch_that_reaches_stop_at_val_acc_and_stays_stopped(tmp_path, rgb, caplog):
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="capsnet"):
        assert _train(out, rgb, "--epochs", "4", "--stop-at-val-acc", "0.01") == 0  # (any score reaches 1%)
    assert "reached --stop-at-val-acc 0.01 at epoch 1 of 4: training stops here" in caplog.text
    assert len(read_summary(out)) == 1 and load_state(out)["epoch"] == 1
    report = json.loads((out / "test.json").read_text())
    assert report["epochs"] == 1 and report["best"]["epoch"] == 1 and 0 <= report["best"]["accuracy"] <= 1
    # Resumed, it trains no further (the threshold is recorded) and scores the test split again; a threshold
    # given again may change (it says how long to train), and a higher one that is not reached trains on.
    assert _train(out, rgb, "--epochs", "4", "--resume") == 0
    assert len(read_summary(out)) == 1
    first = read_summary(out)[0]["val_acc"]
    assert _train(out, rgb, "--epochs", "2", "--resume", "--stop-at-val-acc", "1.0") == 0
    assert len(read_summary(out)) == (1 if first >= 1.0 else 2)
    # 0 turns the recorded threshold off: the run trains on to --epochs, and its record says 0 from then on
    assert _train(out, rgb, "--epochs", "3", "--resume", "--stop-at-val-acc", "0") == 0
    assert len(read_summary(out)) == 3 and load_state(out)["epoch"] == 3
    assert json.loads((out / "config.json").read_text())["train"]["stop_at_val_acc"] == 0
    assert _train(out, rgb, "--epochs", "4", "--resume") == 0
    assert len(read_summary(out)) == 4


@pytest.mark.parametrize("value", ["-0.5", "1.5"])
def test_stop_at_val_acc_outside_0_1_or_without_validation_is_one_line_and_exit_2(tmp_path, rgb, capsys, value):
    with pytest.raises(ConfigError, match=r"stop_at_val_acc must be in \[0, 1\] \(0: never stop early\)"):
        TrainConfig(stop_at_val_acc=float(value))
    assert _train(tmp_path / "run", rgb, "--epochs", "1", "--stop-at-val-acc", value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stop_at_val_acc must be in [0, 1]" in err[0], err
    args = ["train", "--dataset", str(rgb), "--out", str(tmp_path / "nv"), "--val-fraction", "0", *MODEL, *QUIET]
    assert main([*args, "--epochs", "1", "--stop-at-val-acc", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stop-at-val-acc needs a validation split" in err[0] and "--val-fraction" in err[0]
    assert not (tmp_path / "nv" / "config.json").exists()
    assert main([*args, "--epochs", "1", "--stop-at-val-acc", "0"]) == 0  # (off: no validation needed)


def test_fit_stops_at_val_acc_too(tmp_path):
    torch.manual_seed(0)
    images, labels = torch.rand(40, 1, 28, 28), torch.arange(40) % 2
    model = capsnet.CapsNet(config=small_config(n_classes=2))
    result = capsnet.fit(model, torch.utils.data.TensorDataset(images, labels), epochs=3, out=tmp_path / "run",
                         val_fraction=0.25, stop_at_val_acc=0.01, epoch_repeats=1, batch_size=10, device="cpu",
                         progress=False, tensorboard=False)  # fmt: skip
    assert result.epochs_done == 1 and len(result.history) == 1
    with pytest.raises(ConfigError, match="stop_at_val_acc= needs a validation split"):
        capsnet.fit(model, torch.utils.data.TensorDataset(images, labels), epochs=1, out=tmp_path / "nv",
                    val_fraction=0, stop_at_val_acc=0.5, device="cpu", progress=False, tensorboard=False)  # fmt: skip


# ----------------------------------------------------------------------------------------------- the monitor
def test_the_monitor_compares_in_order_and_ties_keep_the_earlier():
    acc, loss, both = (Monitor.parse(s) for s in ("val_accuracy", "val_loss", "val_accuracy,val_loss"))
    earlier, fewer_loss = {"accuracy": 0.975, "loss": 0.0202}, {"accuracy": 0.975, "loss": 0.0186}
    assert not acc.better(fewer_loss, earlier)  # one accuracy: a tie keeps the earlier epoch
    assert both.better(fewer_loss, earlier) and loss.better(fewer_loss, earlier)
    assert not both.better({"accuracy": 0.9733, "loss": 0.01}, earlier)  # accuracy first
    assert loss.better({"accuracy": 0.9733, "loss": 0.01}, earlier)
    assert acc.better(earlier, None) and not acc.better(earlier, dict(earlier))
    assert loss.better({"loss": 5.0}, {"loss": math.nan}) and not loss.better({"loss": math.nan}, {"loss": 5.0})
    assert both.metric("val") == "val_acc" and loss.metric("test") == "test_loss"
    assert DEFAULT_MONITOR == "val_loss"


@pytest.mark.parametrize("spec", ["val_acc", "loss", "val_loss,val_loss", "", "val_accuracy;val_loss"])
def test_a_monitor_that_is_not_one_is_one_line_and_exit_2(tmp_path, rgb, capsys, spec):
    with pytest.raises(ConfigError, match="monitor must be val_accuracy, val_loss or a comma list"):
        TrainConfig(monitor=spec)
    assert _train(tmp_path / "run", rgb, "--epochs", "1", "--monitor", spec) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "monitor must be" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("ema", ["0", "1", "-0.5", "1.5"])
def test_an_ema_decay_outside_0_1_is_one_line_and_exit_2(tmp_path, rgb, capsys, ema):
    assert _train(tmp_path / "run", rgb, "--epochs", "1", "--ema", ema) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ema must be a decay in (0, 1)" in err[0], err


# `make check` trains the default (None: val_loss) and val_accuracy; `make test` all four
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param("val_loss", marks=pytest.mark.slow),
        "val_accuracy",
        pytest.param("val_accuracy,val_loss", marks=pytest.mark.slow),
        None,
    ],
)
def test_best_is_what_the_monitor_picks_from_the_history_and_test_json_says_so(tmp_path, rgb, spec):
    flags = ["--monitor", spec] if spec else []
    assert _train(tmp_path / "run", rgb, "--epochs", "3", *flags) == 0
    rows = load_state(tmp_path / "run")["history"]  # (exact; summary.csv rounds to 6 digits)
    monitor = Monitor.parse(spec or DEFAULT_MONITOR)
    expected = None
    for row in rows:
        if monitor.better({"accuracy": row["val_acc"], "loss": row["val_loss"]}, expected and expected[1]):
            expected = (int(row["epoch"]), {"accuracy": row["val_acc"], "loss": row["val_loss"]})
    report = json.loads((tmp_path / "run" / "test.json").read_text())
    assert report["monitor"] == (spec or DEFAULT_MONITOR) and report["best"]["epoch"] == expected[0]
    assert report["selected_on"] == monitor.metric("val") and report["best"]["weights"] == "raw"
    assert report["best"]["val_loss"] == rows[expected[0] - 1]["val_loss"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["monitor"] == (spec or DEFAULT_MONITOR)
    best = json.loads((tmp_path / "run" / "best" / "config.json").read_text())["checkpoint"]
    assert best["epoch"] == expected[0] and best["monitor"] == (spec or DEFAULT_MONITOR)


def test_the_average_warms_up_then_decays_and_copies_the_buffers():
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.BatchNorm1d(1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    average = WeightAverage(model, decay=0.5)
    with torch.no_grad():
        model[0].weight.fill_(3.0)
        model[1].running_mean.fill_(7.0)
    average.update(model)  # d_1 = min(0.5, 2/11) = 2/11: 2/11 · 1 + 9/11 · 3
    assert average.model[0].weight.item() == pytest.approx(2 / 11 + 27 / 11, abs=1e-6)
    assert average.model[1].running_mean.item() == 7.0 and average.model[1].num_batches_tracked.item() == 0
    with torch.no_grad():
        model[0].weight.fill_(5.0)
    average.updates = 100  # d = min(0.5, 102/111) = 0.5
    before = average.model[0].weight.item()
    average.update(model)
    assert average.model[0].weight.item() == pytest.approx(0.5 * before + 2.5, abs=1e-6)
    assert not average.model.training and not any(p.requires_grad for p in average.model.parameters())


def _ema_rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")} for r in read_summary(run)]


def test_a_run_stopped_mid_epoch_resumes_with_the_same_average_bit_for_bit(tmp_path, rgb):
    common = dict(dataset=str(rgb), batch_size=8, epochs=2, epoch_repeats=1, progress=False, tensorboard=False,
                  device="cpu", val_fraction=0.25, ema=0.9, monitor="val_accuracy,val_loss")  # fmt: skip
    model = small_config(kernel_size=5)
    whole = train(TrainConfig(out=str(tmp_path / "whole"), **common), model)
    stopped = train(TrainConfig(out=str(tmp_path / "parts"), **common), model, on_step=lambda step: step == 8)
    assert stopped.interrupted and load_state(tmp_path / "parts")["batch_in_epoch"] == 2  # 45 images: 6 an epoch
    assert main(["train", "--out", str(tmp_path / "parts"), "--resume"]) == 0
    a, b = load_state(tmp_path / "whole"), load_state(tmp_path / "parts")  # (weights_only loading)
    assert a["ema"]["updates"] == b["ema"]["updates"] == a["step"] == 12 and a["ema"]["decay"] == 0.9
    assert a["ema"]["weights"].keys() == b["ema"]["weights"].keys()
    assert all(torch.equal(a["ema"]["weights"][k], b["ema"]["weights"][k]) for k in a["ema"]["weights"])
    assert not all(torch.equal(a["ema"]["weights"][k], a["model"][k]) for k in a["model"])  # an average, not a copy
    assert _ema_rows(tmp_path / "whole") == _ema_rows(tmp_path / "parts")
    assert "ema_val_acc" in _ema_rows(tmp_path / "whole")[0]
    for view in ("best", "last"):
        x, y = (load_file(str(tmp_path / run / view / "model.safetensors")) for run in ("whole", "parts"))
        assert all(torch.equal(x[k], y[k]) for k in x), view
    report = json.loads((tmp_path / "parts" / "test.json").read_text())
    assert report == json.loads((tmp_path / "whole" / "test.json").read_text())
    assert whole.best["weights"] in ("raw", "ema")
    best = load_file(str(tmp_path / "whole" / "best" / "model.safetensors"))
    source = a["ema"]["weights"] if report["best"]["weights"] == "ema" and report["best"]["epoch"] == 2 else None
    if source is not None:  # best/ is the last epoch's average: its very tensors
        assert all(torch.equal(best[k], source[k]) for k in best)


def test_best_holds_the_weights_that_won_raw_or_average(tmp_path, rgb):
    """Each epoch scores the raw weights, then their average: best/ holds the winner's tensors, test.json names it."""
    common = dict(dataset=str(rgb), batch_size=8, epochs=1, epoch_repeats=1, progress=False, tensorboard=False,
                  device="cpu", val_fraction=0.25, ema=0.5, out=str(tmp_path / "run"), monitor="val_loss")  # fmt: skip
    result = train(TrainConfig(**common), small_config(kernel_size=5))
    state = load_state(tmp_path / "run")
    row = state["history"][0]
    assert result.best["weights"] == ("ema" if row["ema_val_loss"] < row["val_loss"] else "raw")
    weights = state["ema"]["weights"] if result.best["weights"] == "ema" else state["model"]
    best = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    assert all(torch.equal(best[k], weights[k]) for k in best)
    assert result.test is not None and result.test["best"]["weights"] == result.best["weights"]
    prefix = "ema_" if result.best["weights"] == "ema" else ""
    assert result.test["best"]["val_loss"] == row[f"{prefix}val_loss"]


def test_fit_keeps_the_average_and_resumes_it(tmp_path):
    data = torch.utils.data.TensorDataset(torch.rand(48, 1, 16, 16), torch.arange(48) % 3)
    make = lambda: capsnet.create_model("capsnet", **{**small_config(kernel_size=5).__dict__, "image_size": 16,  # noqa: E731
                                                      "n_classes": 3})  # fmt: skip
    kwargs = dict(epochs=2, epoch_repeats=1, batch_size=8, ema=0.8, progress=False, tensorboard=False, seed=1)
    kwargs["device"] = "cpu"
    torch.manual_seed(0)
    capsnet.fit(make(), data, out=tmp_path / "whole", **kwargs)
    torch.manual_seed(0)
    stopped = capsnet.fit(make(), data, out=tmp_path / "parts", on_step=lambda s: s == 3, **kwargs)
    assert stopped.interrupted
    torch.manual_seed(0)
    capsnet.fit(make(), data, out=tmp_path / "parts", resume=True, **{**kwargs, "ema": None})  # (the run's own)
    a, b = load_state(tmp_path / "whole"), load_state(tmp_path / "parts")
    assert a["ema"]["updates"] == 12 and all(torch.equal(a["ema"]["weights"][k], b["ema"]["weights"][k])
                                             for k in a["ema"]["weights"])  # fmt: skip
    assert json.loads((tmp_path / "parts" / "config.json").read_text())["train"]["ema"] == 0.8
    with pytest.raises(ConfigError, match=r"ema=0\.5 conflicts with the run's recorded ema=0\.8"):
        capsnet.fit(make(), data, out=tmp_path / "parts", resume=True, **{**kwargs, "epochs": 3, "ema": 0.5})


def test_under_ddp_the_average_follows_the_model_and_is_saved(tmp_path, rgb, one_rank_ddp, monkeypatch):
    """Under DDP (a one-rank gloo group in this process) the average follows the model inside the wrapper, every
    step, and state.pt keeps it. (DDP keeps the ranks' weights equal, tests/test_distributed.py, so their averages
    are equal too.)"""
    from capsnet.training import build

    made: list[WeightAverage] = []

    class Kept(WeightAverage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(build, "WeightAverage", Kept)
    out = tmp_path / "run"
    config = TrainConfig(
        dataset=str(rgb),
        out=str(out),
        epochs=2,
        epoch_repeats=1,
        batch_size=8,
        ema=0.9,
        device="cpu",
        progress=False,
        tensorboard=False,
        val_fraction=0.25,
    )
    train(config, small_config(kernel_size=5))
    assert len(one_rank_ddp) == 1 and len(made) == 1
    kept, saved = made[0].state_dict(), load_state(out)["ema"]
    assert kept["updates"] == saved["updates"] == load_state(out)["step"] > 0
    for key in kept["weights"]:
        assert torch.equal(kept["weights"][key], saved["weights"][key]), key


def test_the_average_leaves_the_training_of_the_raw_weights_unchanged(tmp_path, rgb):
    """--ema only watches: the raw weights and their history are those of the same run without it (so one --ema
    run also gives the run without, as benchmarks/screen_selection.py reads it)."""
    common = dict(dataset=str(rgb), batch_size=8, epochs=1, epoch_repeats=1, progress=False, tensorboard=False,
                  device="cpu", val_fraction=0.25)  # fmt: skip
    train(TrainConfig(out=str(tmp_path / "plain"), **common), small_config(kernel_size=5))
    train(TrainConfig(out=str(tmp_path / "ema"), ema=0.9, **common), small_config(kernel_size=5))
    a, b = load_state(tmp_path / "plain"), load_state(tmp_path / "ema")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["history"][0]["val_loss"] == b["history"][0]["val_loss"] and "ema" not in a
