"""A run folder has one owner (capsnet.training.runfolder): a second writer is refused with the holder's PID, a
folder that is not a capsnet run or holds a run of other settings is refused with nothing of it changed, the lock
goes with its holder (kill -9 included); `capsnet train` and `capsnet.fit` open and resume in one order (flag and
data errors first), `--resume` says where it continues, and the schedule flags beat a model's own decay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import QUIET_FLAGS, TINY_RUN_FLAGS, write_rgb
from torch import nn

import capsnet
from capsnet import CapsNetConfig
from capsnet.cli import build_parser, main
from capsnet.config import to_dict
from capsnet.errors import ConfigError, DatasetError, RunFolderError
from capsnet.models.efficient_capsnet import EfficientCapsNet
from capsnet.training.api import train
from capsnet.training.checkpoint import load_state, read_summary
from capsnet.training.config import TrainConfig
from capsnet.training.record import RECORD_MARK, resumed_configs
from capsnet.training.runfolder import LOCK_NAME, PID_NAME

MODEL, QUIET = TINY_RUN_FLAGS, QUIET_FLAGS
SMALL = CapsNetConfig(conv_channels=8, primary_types=2, primary_dim=4, class_dim=4, decoder_hidden=(16, 16),
                      kernel_size=5)  # fmt: skip


@pytest.fixture(scope="module")
def rgb(tmp_path_factory) -> Path:
    """40 + 12 RGB images of 16×16 in 3 classes (36 training images at 8 a batch: 5 batches an epoch)."""
    return write_rgb(tmp_path_factory.mktemp("data"), n_train=40)


def _train(out: Path, rgb: Path, *extra: str) -> int:
    return main(["train", "--dataset", str(rgb), "--out", str(out), "--batch-size", "8", *MODEL, *QUIET, *extra])


def _config(out: Path, rgb: Path, **kw) -> TrainConfig:
    common = dict(dataset=str(rgb), batch_size=8, epochs=1, epoch_repeats=1, device="cpu", progress=False)
    common["tensorboard"] = False
    return TrainConfig(out=str(out), **{**common, **kw})


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes (the lock file aside: it holds the PID only while held)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in (LOCK_NAME, PID_NAME)}  # fmt: skip


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


class Linear(nn.Module):
    """A module of one's own for capsnet.fit."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 3))

    def forward(self, images, labels=None):
        logits = self.net(images)
        return SimpleNamespace(logits=logits, predictions=logits.argmax(dim=1))

    def loss(self, out, images, labels):
        return nn.functional.cross_entropy(out.logits, labels), {}


def _data(n: int = 24) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.rand(n, 3, 16, 16, generator=g), torch.arange(n) % 3)


FIT = dict(epochs=1, batch_size=8, device="cpu", progress=False, tensorboard=False)


# ------------------------------------------------------------------------------------------------ the lock
def test_a_second_training_on_a_folder_in_use_is_refused_and_the_first_finishes_whole(tmp_path, rgb, capsys):
    """While a run trains (here held at its first step), `capsnet train` on its folder exits 2 naming the holder's
    PID; `capsnet.fit` raises the same error; the first run then finishes with a folder of its own alone."""
    out, entered, go_on = tmp_path / "run", threading.Event(), threading.Event()
    results = []

    def hold(step: int) -> bool:
        entered.set()
        go_on.wait(60)
        return False

    first = threading.Thread(target=lambda: results.append(train(_config(out, rgb, epochs=2), SMALL, on_step=hold)))
    first.start()
    try:
        assert entered.wait(60)
        assert (out / PID_NAME).read_text().strip() == str(os.getpid())
        capsys.readouterr()
        assert _train(out, rgb, "--epochs", "1", "--batch-size", "4") == 2  # (other settings too: refused first)
        line = _one_line(capsys)
        assert line == (f"capsnet train: error: {out} is in use by another capsnet run (PID {os.getpid()}); wait "
                        "for it to end or choose another --out")  # fmt: skip
        with pytest.raises(RunFolderError, match=rf"in use by another capsnet run \(PID {os.getpid()}\).*another out"):
            capsnet.fit(Linear(), _data(), out=out, **FIT)
    finally:
        go_on.set()
        first.join(120)
    assert results and results[0].epochs_done == 2 and not results[0].interrupted
    meta = json.loads((out / "config.json").read_text())
    assert meta["train"]["epochs"] == 2 and meta["train"]["batch_size"] == 8 and meta["task"] != "loader"
    assert [r["epoch"] for r in read_summary(out)] == [1, 2] and load_state(out)["epoch"] == 2
    assert (out / "test.json").is_file() and not (out / PID_NAME).exists()  # released: no holder


@pytest.mark.slow
def test_the_lock_names_another_process_and_goes_with_it_when_it_is_killed(tmp_path, rgb, capsys):
    """A `capsnet train` process holds the folder: another is refused with its PID. Killed with SIGKILL (no
    handler runs), it leaves the lock free: the run resumes from its last checkpoint."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    argv = ["train", "--dataset", str(rgb), "--out", str(out), "--batch-size", "8", *MODEL, *QUIET,
            "--epochs", "500"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "capsnet", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (out / "state.pt").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert (out / PID_NAME).read_text().strip() == str(proc.pid)
        capsys.readouterr()
        assert main(["train", "--out", str(out), "--resume", "--epochs", "2", *QUIET]) == 2
        assert f"is in use by another capsnet run (PID {proc.pid})" in _one_line(capsys)
    finally:
        proc.kill()
        proc.wait(60)
    assert main(["train", "--out", str(out), "--resume", "--epochs", str(load_state(out)["epoch"] + 1)]) == 0
    assert "resumed at epoch" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ ownership
def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, rgb, capsys):
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "config.json").write_text('{"mine": true}\n')  # the user's own config.json and summary.csv
    (mine / "summary.csv").write_text("a,b\n1,2\n")
    (mine / "notes" / "todo.txt").write_text("keep\n")
    before = _snapshot(mine)
    assert _train(mine, rgb, "--epochs", "1") == 2
    assert _one_line(capsys) == (f"capsnet train: error: {mine} is not a capsnet run folder (it holds config.json, "
                                 "notes, summary.csv); a run is written into a new or empty folder, or one of its "
                                 "own: choose another --out")  # fmt: skip
    assert _train(mine, rgb, "--resume") == 2
    assert _one_line(capsys) == f"capsnet train: error: --resume: {mine} holds no state.pt to continue from"
    with pytest.raises(RunFolderError, match=r"is not a capsnet run folder .*choose another out$"):
        capsnet.fit(Linear(), _data(), out=mine, **FIT)
    assert _snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["config.json", "notes",
                                                                                    "summary.csv"]  # fmt: skip
    (tmp_path / "file").write_text("x")
    assert _train(tmp_path / "file", rgb) == 2
    assert _one_line(capsys).endswith("file: not a folder (the run folder to train into)")
    assert (tmp_path / "file").read_text() == "x"


def test_a_run_of_other_settings_is_refused_without_resume_and_left_as_it_was(tmp_path, rgb, capsys):
    run = tmp_path / "run"
    assert _train(run, rgb, "--epochs", "1") == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert _train(run, rgb, "--epochs", "1", "--batch-size", "4") == 2
    assert _one_line(capsys) == (f"capsnet train: error: {run} holds a run of other settings (--batch-size 4, "
                                 "recorded --batch-size 8); choose another --out; --resume continues it with its "
                                 "own settings")  # fmt: skip
    assert _train(run, rgb, "--epochs", "3", "--routing-iterations", "1") == 2  # a model option
    assert "(--routing-iterations 1, recorded --routing-iterations 3)" in _one_line(capsys)
    assert _train(run, rgb, "--epochs", "2") == 2  # the same settings: --resume continues it
    assert _one_line(capsys).endswith(f"{run} already holds a run; pass --resume to continue it, or choose another "
                                      "--out")  # fmt: skip
    assert _snapshot(run) == before
    # A run stopped before its first checkpoint (config.json alone): the same settings start it again, others are
    # refused.
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.json").write_bytes((run / "config.json").read_bytes())
    assert _train(early, rgb, "--epochs", "1", "--shift", "0") == 2
    assert f"{early} holds a run of other settings (--shift 0, recorded --shift 2); choose another --out" in (
        _one_line(capsys)
    )
    assert (early / "config.json").read_bytes() == (run / "config.json").read_bytes()
    assert _train(early, rgb, "--epochs", "1") == 0 and (early / "test.json").is_file()
    # capsnet.fit: the same refusals, as RunFolderError.
    fitted = tmp_path / "fitted"
    capsnet.fit(Linear(), _data(), out=fitted, **FIT)
    with pytest.raises(RunFolderError, match=r"holds a run of other settings \(batch_size=4, recorded batch_size=8"):
        capsnet.fit(Linear(), _data(), out=fitted, **{**FIT, "batch_size": 4})
    with pytest.raises(RunFolderError, match=r"already holds a run; pass resume=True"):
        capsnet.fit(Linear(), _data(), out=fitted, **FIT)
    with pytest.raises(RunFolderError, match="holds a run made by capsnet train"):
        capsnet.fit(Linear(), _data(), out=run, **FIT)


# ------------------------------------------------------------------------------------------------ the order
def test_flag_and_data_errors_come_before_the_folder_check(tmp_path, rgb, capsys):
    run = tmp_path / "run"
    assert _train(run, rgb, "--epochs", "1") == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--dataset", str(tmp_path / "nonexistent"), *QUIET]) == 2
    line = _one_line(capsys)
    assert "nonexistent" in line and "already holds" not in line and "other settings" not in line
    assert main(["train", "--out", str(run), "--epochs", "0", *QUIET]) == 2
    assert _one_line(capsys) == "capsnet train: error: TrainConfig: epochs must be >= 1, got 0"
    model = capsnet.create_model("efficient-capsnet", in_channels=3, image_size=16, n_classes=3)
    small = torch.utils.data.TensorDataset(torch.rand(4, 1, 5, 5), torch.zeros(4).long())
    with pytest.raises(DatasetError, match="images are 1x5x5"):  # fit: its data against the model, then the folder
        capsnet.fit(model, small, out=run, **FIT)


def test_resume_says_where_it_continues(tmp_path, rgb, capsys):
    out = tmp_path / "run"
    stopped = train(_config(out, rgb, epochs=2), SMALL, on_step=lambda step: step == 7)
    assert stopped.interrupted and load_state(out)["batch_in_epoch"] == 2
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "resumed at epoch 2, batch 2 of 5"
    assert main(["train", "--out", str(out), "--resume", "--epochs", "3"]) == 0  # at an epoch's start
    assert capsys.readouterr().out.splitlines()[0] == "resumed at epoch 3, batch 0 of 5"
    assert main(["train", "--out", str(out), "--resume", "--epochs", "3"]) == 0  # after the last epoch
    assert capsys.readouterr().out.splitlines()[0] == "resumed after its last epoch (3)"


def test_the_settings_a_resume_may_change_are_those_the_command_takes(tmp_path, rgb, capsys):
    """The conflict line lists what may change in the caller's terms: flags `capsnet train` accepts (no
    --workers), keywords capsnet.fit accepts (workers=, no data_dir=)."""
    run = tmp_path / "run"
    assert _train(run, rgb, "--epochs", "1") == 0
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--seed", "3"]) == 2
    listed = _one_line(capsys).split("only these may change: ")[1].split(", ")
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    options = {o for action in train_parser._actions for o in action.option_strings}
    assert "--workers" not in listed and {"--epochs", "--lr-end", "--device", "--data-dir"} <= set(listed)
    assert set(listed) <= options
    fitted = tmp_path / "fitted"
    capsnet.fit(Linear(), _data(), out=fitted, **FIT)
    with pytest.raises(ConfigError) as e:
        capsnet.fit(Linear(), _data(), out=fitted, resume=True, **{**FIT, "seed": 3})
    keywords = str(e.value).split("only these may change: ")[1].split(", ")
    assert "workers" in keywords and "data_dir" not in keywords
    import inspect

    assert set(keywords) <= set(inspect.signature(capsnet.fit).parameters)


def test_a_config_files_out_is_the_run_that_resume_continues(tmp_path, rgb, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(f"dataset: {rgb}\nout: mine\nbatch_size: 8\nepoch_repeats: 1\ndevice: cpu\nprogress: false\n"
                      "tensorboard: false\nmodel:\n  conv_channels: 8\n  primary_types: 2\n  primary_dim: 4\n"
                      "  class_dim: 4\n  decoder_hidden: [16, 16]\n  kernel_size: 5\n")  # fmt: skip
    assert main(["train", "--config", str(config), "--epochs", "1"]) == 0
    assert main(["train", "--config", str(config), "--resume", "--epochs", "2"]) == 0
    assert [r["epoch"] for r in read_summary(tmp_path / "mine")] == [1, 2]
    assert not (tmp_path / "runs").exists()
    config.write_text("out: [1]\n")
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--resume"]) == 2
    assert _one_line(capsys).endswith("c.yaml: 'out' must be a folder name, got [1]")


# ------------------------------------------------------------------------------------------------ schedule
def test_an_explicit_lr_end_beats_the_models_own_decay_and_both_flags_are_one_line(tmp_path, capsys):
    own = EfficientCapsNet.default_lr_decay
    assert TrainConfig(model="efficient-capsnet", epochs=5).decay_per_epoch == own == 0.97
    assert TrainConfig(model="efficient-capsnet", epochs=3, lr_end=0.25).decay_per_epoch == pytest.approx(0.5)
    assert TrainConfig(model="efficient-capsnet", epochs=3, lr_decay=0.9).decay_per_epoch == 0.9
    assert TrainConfig(epochs=3).decay_per_epoch == pytest.approx(0.5)  # (no decay of its own: lr_end 0.25)
    assert main(["train", "--lr-decay", "0.9", "--lr-end", "0.5", "--out", str(tmp_path / "r")]) == 2
    assert _one_line(capsys) == ("capsnet train: error: TrainConfig: lr_decay 0.9 and lr_end 0.5 both set the "
                                 "learning rate's decay: give one (--lr-decay, a factor per epoch, or --lr-end, "
                                 "the last epoch's share of lr)")  # fmt: skip
    assert not (tmp_path / "r").exists()
    model = capsnet.create_model("efficient-capsnet", in_channels=3, image_size=16, n_classes=3)
    with pytest.raises(ConfigError, match="both set the learning rate's decay"):
        capsnet.fit(model, _data(), out=tmp_path / "f", lr_decay=0.9, lr_end=0.5, **FIT)


def test_a_resume_takes_the_schedule_given(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    record = {"train": to_dict(TrainConfig(out=str(run), lr_decay=0.9, batch_size=8)), "model": to_dict(SMALL),
              "task": "classification", RECORD_MARK: capsnet.__version__}  # fmt: skip
    (run / "config.json").write_text(json.dumps(record))
    config, _ = resumed_configs(run, {"lr_end": 0.5})  # one schedule given replaces the run's other
    assert (config.lr_decay, config.lr_end) == (None, 0.5)
    config, _ = resumed_configs(run, {})
    assert (config.lr_decay, config.lr_end) == (0.9, None)
