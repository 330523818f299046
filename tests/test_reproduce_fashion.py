"""`capsnet reproduce fashion-mnist`: the recipes, the run folders that resume or are skipped, the seed summary, and
bad input (one line, exit 2). End to end on a stand-in written in Fashion-MNIST's IDX format."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from capsnet.cli import main
from capsnet.data import load_dataset
from capsnet.data.sources import load
from capsnet.errors import ConfigError, DatasetError
from capsnet.experiments import fashion_mnist as fm
from capsnet.models.registry import MODELS
from capsnet.training.classification import ClassificationTask
from capsnet.training.config import TrainConfig


def write_idx_standin(folder: Path, *, n_train: int = 700, n_test: int = 200, seed: int = 0) -> Path:
    """Fashion-MNIST's four IDX files with learnable stand-in images: class k is a bright bar at row 2k + 4."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        images = (rng.random((n, 28, 28)) * 60).astype(np.uint8)
        for i, k in enumerate(labels):
            images[i, 2 * k + 4 : 2 * k + 7, 6:22] = 255
        header = struct.pack(">IIII", 2051, n, 28, 28)
        (folder / f"{split}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        (folder / f"{split}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes()
        )
    return folder


def test_every_registered_model_has_a_recipe_and_a_quick_size():
    assert set(fm.RECIPES) == set(MODELS) == set(fm.QUICK_MODELS)
    for name, recipe in fm.RECIPES.items():
        assert recipe.why and recipe.epochs >= 1 and recipe.batch_size >= 1, name
        MODELS[name].config_class(**recipe.model)  # the options exist
        MODELS[name](**fm.QUICK_MODELS[name], **recipe.model)
    assert "flip" in fm.RECIPES["capsnet"].augment  # clothing: a mirror keeps the class


def test_fashion_mnist_is_clothing_with_its_class_names(tmp_path):
    folder = write_idx_standin(tmp_path / "f", n_train=20, n_test=10)
    data = load(folder, "idx", name="fashion-mnist", source=str(folder))
    assert not data.digits and data.class_names[0] == "T-shirt/top" and data.class_names[9] == "Ankle boot"
    assert load(folder, "idx", name="f", source=str(folder)).digits  # an unnamed IDX folder stays a digit set
    assert load_dataset("fashion-mnist", data_dir=str(folder)).class_names == data.class_names
    task = ClassificationTask.from_config(TrainConfig(dataset="fashion-mnist", data_dir=str(folder), augment="flip"))
    assert task.spec.flip  # a mirrored shirt is a shirt
    with pytest.raises(DatasetError, match="a digit set"):
        ClassificationTask.from_config(TrainConfig(dataset=str(folder), augment="flip"))


def test_plan_checks_its_input():
    with pytest.raises(ConfigError, match="no Fashion-MNIST recipe for resnet"):
        fm.Plan(models=["resnet"], seeds=[0])
    with pytest.raises(ConfigError, match="--epochs must be >= 1"):
        fm.Plan(models=["hvc-capsnet"], seeds=[0], epochs=0)
    plan = fm.Plan(models=["hvc-capsnet"], seeds=[0, 1], epochs=7)
    config = plan.train_config("hvc-capsnet", 1, Path("o"))
    assert (config.epochs, config.batch_size, config.augment, config.seed) == (7, 120, "shift=2", 1)
    assert (config.lr, config.lr_decay) == (None, 0.94)


def test_a_run_folder_trained_otherwise_is_an_error(tmp_path):
    plan = fm.Plan(models=["hvc-capsnet"], seeds=[0])
    folder = fm.run_dir(tmp_path, "hvc-capsnet", 0)
    config = plan.train_config("hvc-capsnet", 0, folder)
    assert fm.run_state(config) == "new"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"train": {"batch_size": 64, "augment": "shift=2"}}))
    with pytest.raises(ConfigError, match="trained with batch_size 64, this command asks for 120"):
        fm.run_state(config)


@pytest.mark.parametrize("argv,message", [
    (["--model", "resnet"], "no Fashion-MNIST recipe for resnet"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--dataset", "mnist"], "--dataset mnist: not a folder"),
    (["--affnist", "x"], "--affnist: an option of `capsnet reproduce affnist` only"),
    (["--device", "tpu"], "tpu"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main(["reproduce", "fashion-mnist", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "fashion-mnist").exists()  # nothing trained, nothing written


def test_fashion_options_are_refused_by_the_other_experiments(capsys):
    assert main(["reproduce", "mnist", "--seeds", "3"]) == 2
    assert "--seeds: options of `capsnet reproduce fashion-mnist` and `zoo` only" in capsys.readouterr().err
    assert main(["reproduce", "mnist", "--epochs", "0"]) == 2
    assert "--epochs must be >= 1, got 0" in capsys.readouterr().err


def test_epochs_and_batch_size_size_every_experiment():
    import argparse

    from capsnet.cli.reproduce import _sized
    from capsnet.experiments import image_sets
    from capsnet.experiments.reproduce import setting_for

    args = argparse.Namespace(epochs=2, batch_size=8)
    sized = _sized(setting_for("mnist", quick=True), args)
    assert (sized.epochs, sized.batch_size) == (2, 8) and sized.note.endswith("epochs 2, batch size 8 as given")
    assert _sized(image_sets.setting_for("svhn", quick=True, out="o"), args).epochs == 2
    unchanged = setting_for("mnist", quick=True)
    assert _sized(unchanged, argparse.Namespace(epochs=None, batch_size=None)) is unchanged


def _command(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["reproduce", "fashion-mnist", "--quick", "--model", "hvc-capsnet", "--dataset", str(folder), "--out",
            str(out), "--device", "cpu", *extra]  # fmt: skip


@pytest.mark.slow
def test_quick_reproduction_reports_every_seed_resumes_and_skips(tmp_path, capsys):
    from capsnet.training.api import train

    folder, out = write_idx_standin(tmp_path / "standin"), tmp_path / "out"
    # seed 1 stopped after 3 steps (as by Ctrl-C): the command continues it from its checkpoint
    plan = fm.Plan(models=["hvc-capsnet"], seeds=[0, 1], quick=True, data_dir=str(folder), device="cpu")
    stopped = plan.train_config("hvc-capsnet", 1, fm.run_dir(out, "hvc-capsnet", 1), progress=False)
    assert train(stopped, plan.model_config("hvc-capsnet"), on_step=lambda step: step >= 3).interrupted
    assert main(_command(folder, out, "--seeds", "2")) == 0
    printed = capsys.readouterr().out
    assert "hvc-capsnet seed 0 (starting" in printed and "hvc-capsnet seed 1 (continuing" in printed
    report = json.loads((out / "fashion-mnist" / "results.json").read_text())
    (model,) = report["models"]
    assert [r["seed"] for r in model["seeds"]] == [0, 1] and report["quick"]
    for row, acc in zip(model["seeds"], model["test_accs"], strict=True):
        test = json.loads((Path(row["run_dir"]) / "test.json").read_text())
        assert test["selected_on"] == "val_loss" and acc == pytest.approx(100 * test["best"]["accuracy"])
        assert test["best"]["n"] == 200  # the stand-in's test split, scored once at the end
        config = json.loads((Path(row["run_dir"]) / "config.json").read_text())
        assert config["train"]["val_fraction"] == 0.1 and config["model"]["channels"] == [4, 4, 6, 6, 6, 8, 8, 8, 8]
    accs = model["test_accs"]
    assert model["test_acc_mean"] == pytest.approx(sum(accs) / 2)
    assert model["test_acc_std"] == pytest.approx(abs(accs[0] - accs[1]) / 2**0.5)
    table = (out / "fashion-mnist" / "results.md").read_text()
    assert "QUICK" in table and f"{model['test_acc_mean']:.2f} ± {model['test_acc_std']:.2f}" in table
    # the same command again: both runs finished, nothing trains, the report is the same
    weights = fm.run_dir(out, "hvc-capsnet", 0) / "best" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert main(_command(folder, out, "--seeds", "2")) == 0
    assert "starting" not in capsys.readouterr().out and weights.stat().st_mtime_ns == stamp
    assert json.loads((out / "fashion-mnist" / "results.json").read_text())["models"] == report["models"]
    # other settings on the same folders: one line, exit 2, nothing touched
    assert main(_command(folder, out, "--seeds", "2", "--batch-size", "8")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained with batch_size 16, this command asks for 8" in err[0]
    assert weights.stat().st_mtime_ns == stamp
