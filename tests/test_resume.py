"""A resumed run keeps its own settings (capsnet.training.resume): `capsnet train --out RUN --resume` and
`capsnet.training.resume(RUN)` read the run's config.json; a flag given again must agree with it unless it may
change on resume; a run without format_version resumes, a later format is refused; a state.pt of another model is
one line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import QUIET_FLAGS, TINY_RUN_FLAGS, write_rgb
from safetensors.torch import load_file

from capsnet.cli import main
from capsnet.errors import CheckpointError, ConfigError
from capsnet.training import classification, resume
from capsnet.training.api import train
from capsnet.training.checkpoint import load_state, read_summary
from capsnet.training.config import TrainConfig
from capsnet.training.record import MAY_CHANGE

MODEL, QUIET = TINY_RUN_FLAGS, QUIET_FLAGS


@pytest.fixture(scope="module")
def rgb(tmp_path_factory) -> Path:
    """40 + 12 RGB images of 16×16 in 3 classes: a data set that is not the default one."""
    return write_rgb(tmp_path_factory.mktemp("data"), n_train=40)


def _train(out: Path, rgb: Path, *extra: str) -> int:
    return main(["train", "--dataset", str(rgb), "--out", str(out), "--batch-size", "8", *MODEL, *QUIET, *extra])


def _weights(run: Path) -> dict:
    return load_file(str(run / "last" / "model.safetensors"))


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")} for r in read_summary(run)]


@pytest.mark.slow
def test_resume_without_repeating_the_flags_continues_the_same_run(tmp_path, rgb, capsys):
    assert _train(tmp_path / "whole", rgb, "--epochs", "2") == 0
    assert _train(tmp_path / "run", rgb, "--epochs", "1") == 0
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--epochs", "2"]) == 0  # no --dataset, ...
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["train"]["dataset"] == str(rgb) and meta["train"]["epochs"] == 2 and meta["model"]["in_channels"] == 3
    assert meta["train"]["progress"] is False  # (what the first start was told, kept)
    # The same run as one of 2 epochs: weights, summary (the stretched schedule follows --epochs) and test figures.
    whole, run = _weights(tmp_path / "whole"), _weights(tmp_path / "run")
    assert whole.keys() == run.keys() and all(torch.equal(whole[k], run[k]) for k in whole)
    assert _rows(tmp_path / "whole") == _rows(tmp_path / "run")
    # What may change does: another evaluation batch size, device spelling, progress.
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--epochs", "3", "--eval-batch-size", "5",
                 "--device", "cpu", "--progress"]) == 0  # fmt: skip
    assert [r["epoch"] for r in read_summary(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--dataset", "mnist-sample"], "--dataset mnist-sample conflicts with the run's recorded --dataset {rgb}"),
        (["--batch-size", "4"], "--batch-size 4 conflicts with the run's recorded --batch-size 8"),
        (["--seed", "1", "--shift", "0"], "--seed 1 conflicts with the run's recorded --seed 0 (also --shift 0)"),
        (["--routing-iterations", "1"], "--routing-iterations 1 conflicts with the run's recorded --routing-iter"),
        (["--model", "baseline"], "--model baseline conflicts with the run's recorded --model capsnet"),
        (["--channels", "4", "4"], "--channels 4 4 is not an option of the run's model capsnet"),
        (["--config", "{config}"], "--val-fraction 0.5 conflicts with the run's recorded --val-fraction 0.1"),
    ],
)  # fmt: skip
def test_a_flag_that_disagrees_with_the_run_is_one_line_naming_both_values(tmp_path, rgb, capsys, flags, line):
    assert _train(tmp_path / "run", rgb, "--epochs", "1") == 0
    (tmp_path / "c.yaml").write_text("val_fraction: 0.5\n")
    flags = [f.format(config=tmp_path / "c.yaml") for f in flags]
    before = (tmp_path / "run" / "config.json").read_text()
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--epochs", "2", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"capsnet train: error: {tmp_path / 'run'}: "), err
    assert line.format(rgb=rgb) in err[0]
    if "conflicts" in line:
        assert (
            "only these may change: --epochs, --stop-at-val-acc, --lr-decay, --lr-end, --eval-batch-size, --device"
            in err[0]
        )
    assert (tmp_path / "run" / "config.json").read_text() == before  # nothing rewritten


def test_may_change_is_the_documented_list():
    root = Path(__file__).parents[1]
    readme = "".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    assert set(MAY_CHANGE) >= {"epochs", "device", "progress", "tensorboard", "workers", "eval_batch_size"}
    assert "batch_size" not in MAY_CHANGE and "lr" not in MAY_CHANGE and "seed" not in MAY_CHANGE
    flags = set(TrainConfig.__dataclass_fields__)
    for key in MAY_CHANGE[:-2]:  # (out and resume say which run, and to resume it)
        assert (f"--{key.replace('_', '-')}" if key in flags else f"`{key}`") in readme, key


def test_the_python_api_resumes_mid_epoch_with_the_runs_batch_size(tmp_path, rgb):
    """Stopped mid-epoch and resumed by capsnet.training.resume (no batch size given): the run's own batch size, so
    the done batches are skipped exactly, and the run ends as the uninterrupted one."""
    common = dict(dataset=str(rgb), batch_size=8, epochs=2, epoch_repeats=1, progress=False, tensorboard=False,
                  device="cpu", train_subset=40)  # fmt: skip
    from helpers import small_config

    model = small_config(kernel_size=5)
    train(TrainConfig(out=str(tmp_path / "whole"), **common), model)
    stopped = train(TrainConfig(out=str(tmp_path / "parts"), **common), model, on_step=lambda step: step == 7)
    assert stopped.interrupted and load_state(tmp_path / "parts")["batch_in_epoch"] == 2  # 36 images: 5 a epoch
    with pytest.raises(ConfigError, match=r"batch_size=4 conflicts with the run's recorded batch_size=8"):
        resume(tmp_path / "parts", batch_size=4)
    with pytest.raises(ConfigError, match=r"routing_iterations=2 conflicts with the run's recorded routing_iter"):
        resume(tmp_path / "parts", routing_iterations=2)
    result = resume(tmp_path / "parts")
    assert result.epochs_done == 2 and not result.interrupted
    whole, parts = _weights(tmp_path / "whole"), _weights(tmp_path / "parts")
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
    assert _rows(tmp_path / "whole") == _rows(tmp_path / "parts")


def test_train_with_a_config_that_disagrees_is_refused_before_any_data_is_read(tmp_path, rgb, monkeypatch):
    assert _train(tmp_path / "run", rgb, "--epochs", "1") == 0

    def no_data(*args, **kwargs):
        raise AssertionError("the data set was read")

    monkeypatch.setattr(classification, "load_dataset", no_data)
    with pytest.raises(ConfigError, match=rf"dataset='mnist-sample' conflicts with the run's recorded dataset='{rgb}'"
                       r".*capsnet.training.resume\(OUT, \*\*changes\)"):  # fmt: skip
        train(TrainConfig(out=str(tmp_path / "run"), resume=True, epochs=2, progress=False))


def test_a_run_without_format_version_resumes_and_a_later_format_is_one_line(tmp_path, rgb, capsys):
    """config.json and state.pt carry format_version 1; a run written before it existed (today's runs in flight)
    resumes as it is; a later format is refused in one line, the folder left as it was."""
    run = tmp_path / "run"
    assert _train(run, rgb, "--epochs", "1") == 0
    meta, state = json.loads((run / "config.json").read_text()), torch.load(run / "state.pt", weights_only=True)
    assert meta["format_version"] == 1 and state["format_version"] == 1
    del meta["format_version"], state["format_version"]  # as written before format_version
    (run / "config.json").write_text(json.dumps(meta))
    torch.save(state, run / "state.pt")
    assert main(["train", "--out", str(run), "--resume", "--epochs", "2", *QUIET]) == 0
    assert [r["epoch"] for r in read_summary(run)] == [1, 2]
    for name in ("config.json", "state.pt"):
        later = tmp_path / name
        shutil.copytree(run, later)
        if name == "config.json":
            meta = json.loads((later / name).read_text())
            (later / name).write_text(json.dumps({**meta, "format_version": 2}))
        else:
            torch.save({**torch.load(later / name, weights_only=True), "format_version": 2}, later / name)
        before = {p: p.read_bytes() for p in later.rglob("*") if p.is_file() and not p.name.startswith(".capsnet")}
        capsys.readouterr()
        assert main(["train", "--out", str(later), "--resume", "--epochs", "3", *QUIET]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{later / name}: format_version 2, written by a newer capsnet" in err[0], err
        assert {p: p.read_bytes() for p in later.rglob("*") if p.is_file() and not p.name.startswith(".capsnet")} \
            == before  # fmt: skip


def test_a_state_of_another_model_is_one_line_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--train-subset", "16", "--test-subset", "16", "--batch-size", "8", *QUIET]
    assert main(["train", "--model", "baseline", "--channels", "4", "4", "--hidden", "8", "8", "--out", str(run),
                 "--epochs", "1", *flags]) == 0  # fmt: skip
    meta = json.loads((run / "config.json").read_text())
    meta["train"]["model"] = "capsnet"  # a record that no longer says what the state holds
    (run / "config.json").write_text(json.dumps(meta))
    config = TrainConfig(out=str(run), resume=True, epochs=2, train_subset=16, test_subset=16, batch_size=8,
                         device="cpu", progress=False, tensorboard=False)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"state.pt: a run of model 'baseline', not 'capsnet'"):
        train(config)
    state = torch.load(run / "state.pt", weights_only=True)
    del state["model_type"]  # a state.pt written before it recorded its model
    torch.save(state, run / "state.pt")
    with pytest.raises(CheckpointError, match=r"state.pt: a run of another model, not of 'capsnet' \(.*unknown key"):
        train(config)


def test_a_fit_run_is_not_resumed_by_capsnet_train(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"train": {"epochs": 1}, "task": "loader"}))
    (tmp_path / "run" / "state.pt").write_bytes(b"")
    assert main(["train", "--out", str(tmp_path / "run"), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a run made by capsnet.fit" in err[0] and "capsnet.fit(..., resume=True)" in err[0]


def test_a_mid_epoch_state_resumes_only_under_the_processes_that_wrote_it(tmp_path, rgb, capsys):
    """batch_in_epoch counts each rank's batches of the epoch's split over the processes that wrote state.pt: a
    state.pt from 2 processes, resumed by 1, is one line and exit 2, and the folder is left as it was."""
    from capsnet.training.checkpoint import save_state

    config = TrainConfig(dataset=str(rgb), batch_size=8, epochs=1, progress=False, tensorboard=False, device="cpu",
                         out=str(tmp_path / "run"))  # fmt: skip
    from helpers import small_config

    assert train(config, small_config(kernel_size=5), on_step=lambda step: step == 2).interrupted
    state = load_state(tmp_path / "run")
    assert state["batch_in_epoch"] == 2 and state["running_ranks"] == 1
    save_state(tmp_path / "run", {**state, "running_ranks": 2})
    before = {
        p: p.read_bytes()
        for p in (tmp_path / "run").rglob("*")
        if p.is_file() and p.name not in (".capsnet.lock", ".capsnet.pid")
    }
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path / "run"), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"capsnet train: error: {tmp_path / 'run' / 'state.pt'}: stopped in the middle of epoch 1 under 2 "
                   "process(es); resume it with 2 (torchrun --nproc-per-node 2), not 1"]  # fmt: skip
    after = {
        p: p.read_bytes()
        for p in (tmp_path / "run").rglob("*")
        if p.is_file() and p.name not in (".capsnet.lock", ".capsnet.pid")
    }
    assert after == before
    save_state(tmp_path / "run", state)  # as written by 1 process: it resumes
    assert main(["train", "--out", str(tmp_path / "run"), "--resume"]) == 0
