"""`capsnet train` and capsnet.training.api.train end to end: a run's outputs, resume, Adam and the schedule, checkpoint
writes under kills and SIGTERM, config files and model flags, and bad input as one line and exit status 2."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL_FLAGS, small_config

from capsnet import CapsNet
from capsnet.cli import main
from capsnet.errors import ConfigError
from capsnet.models.baseline import BaselineCNN
from capsnet.training.api import train
from capsnet.training.build import make_adam
from capsnet.training.checkpoint import COLUMNS, load_state, read_summary
from capsnet.training.config import LR_END, TrainConfig

TINY = dict(train_subset=96, test_subset=64, batch_size=32, epochs=2, progress=False)


def _run(tmp_path: Path, name: str, **kw) -> tuple:
    cfg = TrainConfig(out=str(tmp_path / name), **{**TINY, **kw.pop("train", {})})
    return cfg, train(cfg, small_config(), **kw)


@pytest.mark.slow
def test_two_epoch_run_writes_every_output(tmp_path):
    cfg, result = _run(tmp_path, "run", train={"tensorboard": True})
    run = tmp_path / "run"
    assert result.epochs_done == 2 and not result.interrupted
    assert {p.name for p in run.iterdir()} >= {"config.json", "summary.csv", "best", "last", "state.pt", "tb",
                                               "test.json"}  # fmt: skip
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["epochs"] == 2 and config["model"]["conv_channels"] == 16
    rows = read_summary(run)
    assert [r["epoch"] for r in rows] == [1, 2]
    for row in rows:
        assert set(row) == set(COLUMNS)
        assert 0 <= row["val_acc"] <= 1 and row["images_per_s"] > 0 and row["train_loss"] > 0
    assert rows[1]["lr"] == pytest.approx(rows[0]["lr"] * cfg.decay_per_epoch)
    assert rows[-1]["lr"] == pytest.approx(cfg.learning_rate * LR_END)  # the schedule ends at lr × lr_end
    for sub in ("best", "last"):
        model = CapsNet.from_pretrained(run / sub)
        assert model.config.conv_channels == 16
    assert any((run / "tb").iterdir())
    state = load_state(run)  # weights_only=True
    assert state["epoch"] == 2 and state["step"] == 6


def test_fused_adam_matches_the_reference_update():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
    b.load_state_dict(a.state_dict())
    fused = make_adam(list(a.parameters()), lr=1e-2, device=torch.device("cpu"))
    plain = torch.optim.Adam(b.parameters(), lr=1e-2, foreach=False)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4):
        assert fused.defaults["fused"]  # the CPU kernel exists since torch 2.4
    for _ in range(5):
        x = torch.randn(8, 6)
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted(tmp_path):
    _, full = _run(tmp_path, "full")
    _, stopped = _run(tmp_path, "resumed", on_step=lambda step: step == 4)  # stop mid-way through epoch 2
    assert stopped.interrupted and stopped.epochs_done == 1
    state = load_state(tmp_path / "resumed")
    assert (state["epoch"], state["batch_in_epoch"], state["step"]) == (1, 1, 4)
    _, resumed = _run(tmp_path, "resumed", train={"resume": True})
    assert resumed.epochs_done == 2 and not resumed.interrupted
    a = CapsNet.from_pretrained(tmp_path / "full" / "last").state_dict()
    b = CapsNet.from_pretrained(tmp_path / "resumed" / "last").state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for ra, rb in zip(full.history, resumed.history, strict=True):
        for key in ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-9, abs=1e-12), key
    assert full.test == resumed.test


@pytest.mark.slow
def test_resume_extends_a_finished_run(tmp_path):
    cfg, _ = _run(tmp_path, "run", train={"epochs": 2})  # decay 0.25 per epoch: lr_end over 2 epochs
    _, result = _run(tmp_path, "run", train={"epochs": 3, "resume": True})
    rows = read_summary(tmp_path / "run")
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert result.epochs_done == 3
    # the schedule follows the flags of the resumed run: 3 epochs decay by 0.5, so epoch 3 runs at lr × 0.5²
    lr = cfg.learning_rate
    assert [r["lr"] for r in rows] == pytest.approx([lr, lr * 0.25, lr * 0.25])
    _run(tmp_path, "run", train={"epochs": 4, "resume": True, "lr_decay": 0.8})
    assert read_summary(tmp_path / "run")[3]["lr"] == pytest.approx(lr * 0.8**3)


def test_decay_per_epoch_stretches_with_the_run():
    assert TrainConfig(epochs=3).decay_per_epoch == pytest.approx(0.5)  # the sample's tuned 3-epoch schedule
    ten = TrainConfig(epochs=10)
    assert ten.decay_per_epoch**9 == pytest.approx(LR_END) == 0.25  # the 10th epoch runs at lr × lr_end
    assert TrainConfig(epochs=1).decay_per_epoch == 1.0
    assert TrainConfig(epochs=10, lr_decay=0.9).decay_per_epoch == 0.9
    for bad in ({"lr_end": 0.0}, {"lr_end": 1.5}, {"lr_decay": 0.0}, {"lr_decay": 1.2}, {"lr": 0.0}):
        with pytest.raises(ConfigError):
            TrainConfig(**bad)


def test_learning_rate_is_the_models_unless_given():
    assert TrainConfig().learning_rate == CapsNet.default_lr == 1e-3
    assert TrainConfig(model="baseline").learning_rate == BaselineCNN.default_lr == 1e-4
    assert TrainConfig(model="baseline", lr=3e-4).learning_rate == 3e-4


@pytest.mark.slow
def test_kill_during_checkpoint_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    _run(tmp_path, "run", train={"epochs": 1})
    run = tmp_path / "run"
    before = CapsNet.from_pretrained(run / "last").state_dict()
    import capsnet.fileio

    def killed(fd):
        raise KeyboardInterrupt  # the process dies after writing the temporary file, before os.replace

    monkeypatch.setattr(capsnet.fileio.os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "run", train={"epochs": 2, "resume": True})
    monkeypatch.undo()
    after = CapsNet.from_pretrained(run / "last").state_dict()
    for k in before:
        assert torch.equal(before[k], after[k])
    assert load_state(run)["epoch"] == 1
    assert [r["epoch"] for r in read_summary(run)] == [1]
    assert not [p for p in run.rglob("*.tmp")]


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    _run(tmp_path, "run", train={"epochs": 1})
    code = main(["train", "--out", str(tmp_path / "run"), "--epochs", "1", *SMALL_FLAGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--resume" in err[0]


def _cli(*args, cwd=None, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "capsnet", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


BAD_INPUT = [
    (["train", "--epochs", "0"], "epochs must be >= 1"),
    (["train", "--batch-size", "many"], "invalid int value"),
    (["train", "--no-such-flag"], "unrecognized arguments"),
    (["train", "--dataset", "/no/such/folder"], "no such folder"),
    (["train", "--device", "cuda:7"], "CUDA"),
    (["evaluate", "--checkpoint", "/no/such/run"], "no such checkpoint"),
    (["train", "--config", "/no/such/config.yaml"], "config file not found"),
]
# In a process of its own: an error of argparse's and one raised deep in a run (the data set's folder).
IN_A_PROCESS = {"unrecognized arguments", "no such folder"}


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_gives_one_line_and_nonzero_exit(args, needle, tmp_path, capsys):
    argv = [*args, "--out", str(tmp_path / "x")] if args[0] == "train" else args
    try:
        code = main(argv)
    except SystemExit as e:  # (argparse's usage errors)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [case for case in BAD_INPUT if case[1] in IN_A_PROCESS])
def test_bad_input_in_a_process_of_its_own_is_one_line_and_exit_2(args, needle, tmp_path):
    r = _cli(*args, "--out", str(tmp_path / "x"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr


@pytest.mark.slow
def test_corrupt_checkpoint_and_state_give_one_line(tmp_path):
    _run(tmp_path, "run", train={"epochs": 1})
    run = tmp_path / "run"
    (run / "best" / "model.safetensors").write_bytes(b"\x00garbage")
    r = _cli("evaluate", "--checkpoint", str(run))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "safetensors" in r.stderr
    (run / "state.pt").write_bytes(b"not a torch file")
    r = _cli("train", "--out", str(run), "--resume", "--epochs", "2", *SMALL_FLAGS)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "state.pt" in r.stderr


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "epochs: 1\ntrain_subset: 64\ntest_subset: 32\nbatch_size: 32\nmodel:\n  conv_channels: 16\n"
        "  primary_types: 4\n  primary_dim: 4\n  class_dim: 6\n  decoder_hidden: [32, 64]\n"
    )
    code = main(["train", "--config", str(cfg), "--batch-size", "64", "--out", str(tmp_path / "r"), "--no-progress"])
    assert code == 0
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert saved["train"]["batch_size"] == 64 and saved["train"]["epochs"] == 1
    assert saved["model"]["decoder_hidden"] == [32, 64]


@pytest.mark.slow
def test_sigterm_saves_checkpoint_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    cmd = [
        sys.executable,
        "-m",
        "capsnet",
        "train",
        "--out",
        str(out),
        "--epochs",
        "50",
        "--train-subset",
        "64",
        "--test-subset",
        "32",
        "--batch-size",
        "32",
        "--no-progress",
        "--no-tensorboard",
        *SMALL_FLAGS,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 240
    while not (out / "summary.csv").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: checkpoint saved" in stderr and "Traceback" not in stderr
    state = load_state(out)
    assert 1 <= state["epoch"] < 50
    CapsNet.from_pretrained(out / "last")


def test_model_flags_reach_the_chosen_models_config(tmp_path):
    from capsnet.cli import build_parser
    from capsnet.cli.train import configs_from_args
    from capsnet.models.baseline import BaselineConfig

    flags = ["--dropout", "0.25", "--channels", "8", "8", "--kernel-size", "3", "--no-pool"]
    args = build_parser().parse_args(["train", "--model", "baseline", *flags])
    config, model_config = configs_from_args(args)
    assert config.model == "baseline" and isinstance(model_config, BaselineConfig)
    assert (model_config.dropout, model_config.channels, model_config.kernel_size) == (0.25, (8, 8), 3)
    _, capsnet_config = configs_from_args(build_parser().parse_args(["train", "--kernel-size", "5"]))
    assert capsnet_config.kernel_size == 5  # a shared field: one flag, for whichever model is chosen
    out = tmp_path / "b"
    model_flags = ["--dropout", "0.25", "--channels", "8", "8", "4", "--hidden", "16"]
    run_flags = ["--train-subset", "32", "--test-subset", "16", "--epochs", "1", "--no-progress", "--no-tensorboard"]
    code = main(["train", "--model", "baseline", *model_flags, *run_flags, "--out", str(out)])
    assert code == 0
    saved = json.loads((out / "config.json").read_text())["model"]
    assert saved["dropout"] == 0.25 and saved["channels"] == [8, 8, 4] and saved["hidden"] == [16]
    assert BaselineCNN.from_pretrained(out / "last").config.dropout == 0.25


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--conv-channels", "8"], "--conv-channels"),
        (["--no-decoder"], "--decoder"),
        (["--recon-weight", "0.1"], "--recon-weight"),
    ],
)
def test_a_flag_the_model_does_not_take_is_rejected(flags, named, tmp_path, capsys):
    code = main(["train", "--model", "baseline", *flags, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"capsnet train: error: {named} is not an option of --model baseline (it takes: ")
    assert "--dropout" in err[0] and "--kernel-size" in err[0] and not (tmp_path / "r").exists()
    code = main(["train", "--dropout", "0.1", "--out", str(tmp_path / "r")])  # and the other way round
    assert code == 2 and "--dropout is not an option of --model capsnet" in capsys.readouterr().err


def test_a_config_file_model_key_the_model_does_not_take_is_rejected(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text("model:\n  conv_channels: 8\n")
    code = main(["train", "--model", "baseline", "--config", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'conv_channels' is not an option of --model baseline" in err[0]


def test_model_flags_come_from_every_registered_model(monkeypatch):
    from dataclasses import dataclass, field

    from capsnet.cli import build_parser
    from capsnet.cli.train import configs_from_args, model_options
    from capsnet.models import registry

    @dataclass
    class ToyConfig:
        n_classes: int = 10  # filled in from the data: no flag
        kernel_size: int = 3  # shared with CapsNet and the baseline: the same flag
        width: int = field(default=4, metadata={"help": "toy width"})

    class Toy:
        config_class = ToyConfig

    monkeypatch.setitem(registry.MODELS, "toy", Toy)
    options = model_options()
    assert set(options["kernel_size"].models) == {"capsnet", "baseline", "toy"}
    assert set(options["width"].models) == {"toy"} and "n_classes" not in options
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--width" in help_text and "toy width" in help_text
    args = build_parser().parse_args(["train", "--width", "7"])
    with pytest.raises(ConfigError, match="--width is not an option of --model capsnet"):
        configs_from_args(args)

    @dataclass
    class ClashConfig:
        kernel_size: float = 3.0  # a flag cannot be an int for one model and a float for another

    class Clash:
        config_class = ClashConfig

    monkeypatch.setitem(registry.MODELS, "clash", Clash)
    with pytest.raises(TypeError, match="kernel_size"):
        model_options()
