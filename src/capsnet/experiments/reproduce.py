"""`capsnet reproduce mnist|multimnist|affnist`: the paper's experiments, one command each.

Each trains CapsNet and the paper's baseline CNN with the loop of `capsnet.training` (checkpoints, resume,
TensorBoard, torchrun all apply) and prints ours next to the paper's figure:

    mnist       Table 1, MNIST test error: CapsNet (3 routing iterations, reconstruction) 0.25%, baseline 0.39%
    multimnist  Table 1, MultiMNIST test error (§6): CapsNet 5.2%, baseline 8.1%
    affnist     §5.2: expanded MNIST test accuracy CapsNet 99.23%, CNN 99.22%; affNIST CapsNet 79%, CNN 66%

Without --quick the settings are the paper's (full MNIST, full-size models, 1,000 MultiMNIST pairs per digit)
and meant for a GPU. The paper gives no epoch count; the full setting uses FULL_EPOCHS. --quick is a smoke-sized
run for a 2-core CPU on the whole bundled sample: few epochs and pairs, batch 32, and narrower models. Its
figures show that the pipeline works, not what the paper's setting reaches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.datasets import load_dataset
from ..errors import ConfigError, DatasetError
from ..fileio import atomic_write_json
from ..models.baseline import BaselineConfig
from ..models.capsnet import CapsNetConfig
from ..models.pretrained import load_pretrained
from ..training.api import train
from ..training.checkpoint_data import check_split
from ..training.classification import subset, validation_split
from ..training.config import TrainConfig
from ..training.evaluator import evaluate
from ..training.hardware import resolve_device
from ..training.tasks import Task
from .affnist import ExpandedMNISTTask, affine_test_set, load_affnist
from .multimnist import MultiMNISTTask

EXPERIMENTS = ("mnist", "multimnist", "affnist")
FULL_EPOCHS = 50

# The paper's figures: (metric, model) -> value in percent.
PAPER: dict[str, dict[tuple[str, str], float]] = {
    "mnist": {("MNIST test error (%)", "capsnet"): 0.25, ("MNIST test error (%)", "baseline"): 0.39},
    "multimnist": {("MultiMNIST test error (%)", "capsnet"): 5.2, ("MultiMNIST test error (%)", "baseline"): 8.1},
    "affnist": {
        ("expanded MNIST test accuracy (%)", "capsnet"): 99.23,
        ("expanded MNIST test accuracy (%)", "baseline"): 99.22,
        ("affNIST test accuracy (%)", "capsnet"): 79.0,
        ("affNIST test accuracy (%)", "baseline"): 66.0,
    },
}


@dataclass
class Setting:
    """Sizes of one run of an experiment (both models)."""

    dataset: str = "mnist"
    epochs: int = FULL_EPOCHS
    batch_size: int = 128
    lr: float = 1e-3  # both models (the baseline trains at batch 128 and 32 with it; docs/results.md used it)
    train_subset: int | None = None
    test_subset: int | None = None
    pairs_per_digit: int = 1000  # MultiMNIST (§6)
    test_pairs_per_digit: int = 1
    val_fraction: float = 0.1  # held out of the training digits; best/ is chosen on it, the test split read once
    capsnet: dict[str, Any] = field(default_factory=dict)  # CapsNetConfig options (paper's model when empty)
    baseline: dict[str, Any] = field(default_factory=dict)  # BaselineConfig options
    note: str = "full setting"


# Narrower models for --quick (the paper's are 8.2M and 35.4M parameters).
QUICK_CAPSNET = dict(conv_channels=32, primary_types=8, decoder_hidden=(256, 512))
QUICK_BASELINE = dict(channels=(32, 32, 16))


def setting_for(experiment: str, *, quick: bool, dataset: str | None = None) -> Setting:
    if experiment not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")
    if not quick:
        return Setting(dataset=dataset or "mnist", epochs=1 if experiment == "multimnist" else FULL_EPOCHS)
    sizes = {
        "mnist": dict(epochs=5),
        "multimnist": dict(epochs=3, pairs_per_digit=2),
        "affnist": dict(epochs=5),
    }[experiment]
    what = "every training digit"
    if experiment == "multimnist":
        what += f" x {sizes['pairs_per_digit']} pairs each, one test pair per test digit"
    else:
        what += ", every test digit"
    note = (
        f"QUICK run: {what}, {sizes['epochs']} epochs, batch 32, narrower models (CapsNet {QUICK_CAPSNET}, "
        f"baseline {QUICK_BASELINE}); sized for a 2-core CPU, not the paper's setting"
    )
    return Setting(
        dataset=dataset or "mnist-sample",
        batch_size=32,
        capsnet=dict(QUICK_CAPSNET),
        baseline=dict(QUICK_BASELINE),
        note=note,
        **sizes,
    )


def run_experiment(
    experiment: str,
    *,
    quick: bool = False,
    out: str = "runs/reproduce",
    device: str = "auto",
    dataset: str | None = None,
    affnist: str | None = None,
    seed: int = 0,
    resume: bool = False,
    progress: bool = True,
    setting: Setting | None = None,
) -> dict[str, Any]:
    """Train CapsNet and the baseline for `experiment`; write and return {"rows": [...], ...}.

    `setting` overrides the sizes entirely (tests use tiny ones).
    """
    setting = setting or setting_for(experiment, quick=quick, dataset=dataset)
    if experiment not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {experiment!r}; choose one of {', '.join(EXPERIMENTS)}")
    root = Path(out) / experiment
    data = load_dataset(setting.dataset)
    if data.train is None:
        raise DatasetError(f"{data.source}: holds only a test split; training needs the train-* files too")
    train_split, test_split = subset(data.train, setting.train_subset), subset(data.test, setting.test_subset)
    split_config = TrainConfig(val_fraction=setting.val_fraction)
    train_split, val_split, _ = validation_split(train_split, data.val, split_config)
    task: Task | None = None
    affnist_test, affnist_what = None, None
    if experiment == "multimnist":
        task = MultiMNISTTask(
            train=train_split,
            test=test_split,
            val=val_split,
            n_classes=data.n_classes,
            pairs_per_digit=setting.pairs_per_digit,
            test_pairs_per_digit=setting.test_pairs_per_digit,
            seed=seed,
        )
    elif experiment == "affnist":
        task = ExpandedMNISTTask(train=train_split, test=test_split, val=val_split, n_classes=data.n_classes, seed=seed)
        if affnist is not None:
            affnist_test, affnist_what = subset(load_affnist(affnist), setting.test_subset), f"affNIST ({affnist})"
        else:
            affnist_test, affnist_what = affine_test_set(test_split, seed=seed), "affNIST-style (generated)"

    rows, runs = [], {}
    for model in ("capsnet", "baseline"):
        config = TrainConfig(
            dataset=setting.dataset,
            train_subset=setting.train_subset,
            test_subset=setting.test_subset,
            epochs=setting.epochs,
            batch_size=setting.batch_size,
            lr=setting.lr,
            val_fraction=setting.val_fraction,
            seed=seed,
            device=device,
            out=str(root / model),
            resume=resume,
            progress=progress,
            model=model,
        )
        model_config = CapsNetConfig(**setting.capsnet) if model == "capsnet" else BaselineConfig(**setting.baseline)
        print(f"== {experiment}: training {model} -> {config.out}", flush=True)
        result = train(config, model_config, task=task)
        if result.interrupted:
            raise KeyboardInterrupt
        assert result.test is not None  # a finished run has scored its test split
        chosen = result.test.get("best", result.test["last"])  # the checkpoint chosen on validation
        runs[model] = {
            "run_dir": str(result.run_dir),
            "epochs": result.epochs_done,
            "history": result.history,
            "test": result.test,
        }
        metric = next(m for m, who in PAPER[experiment] if who == model)
        ours = 100 * chosen["accuracy"] if "accuracy" in metric else 100 * (1 - chosen["accuracy"])
        rows.append(_row(experiment, metric, model, ours))
        if affnist_test is not None:
            dev = resolve_device(config.device)
            trained = load_pretrained(Path(result.run_dir) / "best", map_location=dev)
            check_split(trained, affnist_test, source=affnist_what or "affNIST")
            acc = evaluate(trained, affnist_test, batch_size=config.eval_batch_size, device=dev)["accuracy"]
            rows.append(_row(experiment, "affNIST test accuracy (%)", model, 100 * acc, note=affnist_what))
    report = {
        "experiment": experiment,
        "quick": quick,
        "setting": dataclasses.asdict(setting),
        "seed": seed,
        "rows": rows,
        "runs": runs,
    }
    atomic_write_json(root / "results.json", report)
    return report


def _row(experiment: str, metric: str, model: str, ours: float, note: str | None = None) -> dict[str, Any]:
    row = {"model": model, "metric": metric, "ours": round(ours, 4), "paper": PAPER[experiment][(metric, model)]}
    if note:
        row["note"] = note
    return row


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'model':<10} {'metric':<34} {'ours':>9} {'paper':>7}"]
    for r in report["rows"]:
        extra = f"  [{r['note']}]" if r.get("note") else ""
        lines.append(f"{r['model']:<10} {r['metric']:<34} {r['ours']:>9.2f} {r['paper']:>7.2f}{extra}")
    return "\n".join(lines)
