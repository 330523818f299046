"""`capsnet reproduce zoo`: every registered model trained and scored the same way on a benchmark, as rows of the
project's results data (capsnet.results, results/BENCHMARK.csv).

Benchmarks (BENCHMARKS):

    sample         the bundled MNIST digits: 5,400 training / 600 validation / 2,000 test; each model at its own
                   defaults (learning rate, decay, batch, augmentation) for the epochs SAMPLE_EPOCHS states
    fashion-mnist  full Fashion-MNIST: 54,000 / 6,000 / 10,000; every model at its own defaults for the same
                   FASHION_EPOCHS (one budget for all)

Each seed is an ordinary `capsnet train` run in OUT/zoo/BENCHMARK/MODEL/seed-K: best/ is chosen on the validation
split (the default monitor, val_loss), and the test split is scored once, at the end, on best/ (test.json). The row
reports every seed's test accuracy of its best/, their mean and std, and best/'s accuracy on the same test images
under one fixed random affine transform (capsnet.data.augment.AFFINE_TEST), kept in the seed's affine.json.

Re-running a command skips finished seeds, continues unfinished ones (`--resume`) and starts missing ones; a model
whose row results/ already holds as done, with the same epochs and seeds, is not trained again (a fresh machine
picks up from results/).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.augment import affine_test_images
from ..data.datasets import load_dataset
from ..data.split import Split
from ..errors import ConfigError
from ..fileio import atomic_write_json
from ..models.pretrained import load_pretrained
from ..models.registry import MODELS
from ..results import Row, read_rows, with_accuracies, write_rows
from ..training.api import train
from ..training.config import TrainConfig
from ..training.evaluator import evaluate
from ..training.hardware import batch_size_for, bf16_native, cpu_flags, resolve_device
from .fashion_mnist import read_test, run_state


@dataclass(frozen=True)
class Benchmark:
    name: str
    dataset: str
    default_epochs: int  # for a model without its own entry
    epochs: dict[str, int]  # model -> its stated budget
    why: str


# Epoch budgets on the bundled sample: each model's own defaults, for as many epochs as a seed can take in about a
# CPU-hour on a 2-core host (docs/benchmarks.md, "The zoo").
SAMPLE_EPOCHS: dict[str, int] = {
    "capsnet": 10,
    "baseline": 10,
    "em-capsnet": 3,
    "efficient-capsnet": 30,
    "inverted-attention-capsnet": 10,
    "self-routing-capsnet": 15,
    "hvc-capsnet": 15,
    "deepcaps": 10,
    # routes 1,024 parts × 64 of 4×4 poses per image: a batch-20 bf16 step takes 1.3 s on one thread beside three
    # other trainings (Intel Xeon, docs/benchmarks.md, Heinsen routing), about 6 min an epoch
    "heinsen-capsnet": 10,
    # 4.6 img/s training at batch 64 on the loaded 2-core machine, about 20 min an epoch; one epoch a seed
    "cluster-capsnet": 1,
    "vb-capsnet": 3,
}
FASHION_EPOCHS = 3  # one budget for every model on full Fashion-MNIST

BENCHMARKS: dict[str, Benchmark] = {
    "sample": Benchmark("sample", "mnist-sample", 10, SAMPLE_EPOCHS, "each model's own defaults and epoch budget"),
    "fashion-mnist": Benchmark(
        "fashion-mnist", "fashion-mnist", FASHION_EPOCHS, {}, f"each model's own defaults, {FASHION_EPOCHS} epochs"
    ),
}
PROTOCOL = "best/ on validation loss (stratified 10% of training), test scored once"

# Full Fashion-MNIST on a CPU: 3 seeds for a model whose seed takes about an hour of the machine or less, 1 seed up
# to ONE_SEED_HOURS, what one sitting of a 2-core machine finishes with its evaluation, and none beyond (its row says
# "not run" and gives the GPU command). One seed's hours are estimated from the model's training speed in
# results/cost.csv (benchmarks/zoo_cost.py) at the plan's precision, on the CPU that row names.
THREE_SEEDS_HOURS = 1.0
ONE_SEED_HOURS = 3.0
FASHION_TRAIN_IMAGES = 54_000  # 60,000 less the validation tenth
INPUT: dict[str, int] = {"in_channels": 1, "image_size": 28, "n_classes": 10}  # both benchmarks' images and classes


@dataclass
class ZooPlan:
    """What one invocation trains: models × seeds on one benchmark."""

    benchmark: str
    models: list[str]
    seeds: list[int]
    out: Path
    precision: str = "auto"
    device: str = "auto"
    data_dir: str | None = None
    results: Path = Path("results")
    progress: bool = True

    def __post_init__(self) -> None:
        if self.precision == "auto":  # bf16 where the device multiplies it natively (measured neutral: docs)
            self.precision = "bf16" if bf16_native(resolve_device(self.device)) else "fp32"
        if self.benchmark not in BENCHMARKS:
            raise ConfigError(f"unknown benchmark {self.benchmark!r}; known: {', '.join(BENCHMARKS)}")
        self.models = [MODELS.canonical(m) for m in self.models]
        if not self.models or not self.seeds:
            raise ConfigError("need at least one model and one seed")

    def epochs(self, model: str) -> int:
        bench = BENCHMARKS[self.benchmark]
        return bench.epochs.get(model, bench.default_epochs)

    def run_dir(self, model: str, seed: int) -> Path:
        return self.out / "zoo" / self.benchmark / self.precision / model / f"seed-{seed}"

    def train_config(self, model: str, seed: int) -> TrainConfig:
        bench = BENCHMARKS[self.benchmark]
        return TrainConfig(
            dataset=bench.dataset,
            data_dir=self.data_dir,
            model=model,
            seed=seed,
            epochs=self.epochs(model),
            precision=self.precision,  # type: ignore[arg-type]
            device=self.device,
            out=str(self.run_dir(model, seed)),
            progress=self.progress,
            tensorboard=False,
        )

    def command(self, model: str, seeds: int | None = None, *, device: str | None = None) -> str:
        first = f" --seed {self.seeds[0]}" if self.seeds[0] else ""
        on = f" --device {device}" if device else ""
        return (
            f"capsnet reproduce zoo --benchmark {self.benchmark} --model {model} --seeds {seeds or len(self.seeds)}"
            f"{first} --precision {self.precision}{on}"
        )

    def seeds_for(self, model: str) -> tuple[list[int], str]:
        """The seeds this plan trains for `model` and its row's status: every seed, "done", except for full
        Fashion-MNIST on a CPU, where a model gets the seeds its estimated time allows (THREE_SEEDS_HOURS,
        ONE_SEED_HOURS; all of them where results/cost.csv has no speed for it)."""
        if self.benchmark != "fashion-mnist" or resolve_device(self.device).type != "cpu":
            return self.seeds, "done"
        measured = seed_hours(self.results, model, self.precision, self.epochs(model))
        if measured is None:
            return self.seeds, "done"
        hours, cpu = measured
        if hours <= THREE_SEEDS_HOURS or (len(self.seeds) == 1 and hours <= ONE_SEED_HOURS):
            return self.seeds, "done"
        estimate = f"one seed ≈ {hours:.1f} h on {cpu or 'the CPU of results/cost.csv'} (results/cost.csv)"
        if hours <= ONE_SEED_HOURS:
            return self.seeds[:1], f"1 seed: {estimate}"
        return [], f"not run: {estimate}"


def seed_hours(results: Path, model: str, precision: str, epochs: int) -> tuple[float, str] | None:
    """One seed's training on full Fashion-MNIST, in hours (evaluation not counted), at the training speed
    results/cost.csv measured for (model, precision), and the CPU that measured it; None where it has no such row."""
    path = results / "cost.csv"
    rows = read_rows(path) if path.is_file() else []
    row = next((r for r in rows if (r.model, r.precision) == (model, precision) and r.train_img_s), None)
    if row is None or row.train_img_s is None:
        return None
    return epochs * FASHION_TRAIN_IMAGES / row.train_img_s / 3600, row.cpu


def train_seed(plan: ZooPlan, model: str, seed: int) -> dict[str, Any]:
    """Train, continue or skip one seed's run; returns its test.json with the affine accuracy added."""
    config = plan.train_config(model, seed)
    state = run_state(config)
    folder = Path(config.out)
    if state != "finished":
        doing = "continuing" if state == "unfinished" else "starting"
        print(f"== zoo {plan.benchmark}: {model} seed {seed} ({doing}, {config.epochs} epochs) -> {folder}", flush=True)
        result = train(dataclasses.replace(config, resume=state == "unfinished"))
        if result.interrupted:
            raise KeyboardInterrupt
    test = read_test(folder)
    if test is None:
        raise ConfigError(f"{folder}: the run ended without a test.json")
    return {**test, "affine": affine_accuracy(folder, plan), "config": _recorded(folder)}


def affine_accuracy(folder: Path, plan: ZooPlan) -> float:
    """best/'s accuracy on the run's test images under the affine transform (cached in the seed's affine.json)."""
    cached = folder / "affine.json"
    if cached.is_file():
        return float(json.loads(cached.read_text(encoding="utf-8"))["accuracy"])
    n = _recorded(folder)["train"].get("test_subset")  # the images the run's test.json scored
    test = load_dataset(BENCHMARKS[plan.benchmark].dataset, data_dir=plan.data_dir).test
    images, labels = test.images[:n], test.labels[:n]
    split = Split(affine_test_images(images), labels, test.channel_stats)
    accuracy = evaluate(load_pretrained(folder / "best"), split)["accuracy"]
    atomic_write_json(cached, {"accuracy": accuracy, "n": len(labels), "transform": "capsnet.data.augment.AFFINE_TEST"})
    return accuracy


def _recorded(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def model_row(plan: ZooPlan, model: str, seeds: list[dict[str, Any]], numbers: list[int], status: str) -> Row:
    """The results row of one model's seeds (`numbers`, their `seeds` results)."""
    record = seeds[0]["config"]
    train_cfg = record["train"]
    trained = load_pretrained(Path(train_cfg["out"]) / "best")
    data = load_dataset(BENCHMARKS[plan.benchmark].dataset, data_dir=plan.data_dir)
    n_val = int(record["validation"]["n"])
    best = [s["best"] for s in seeds]
    row = Row(
        model=model,
        params=sum(p.numel() for p in trained.parameters()),
        benchmark=plan.benchmark,
        protocol=PROTOCOL,
        train_images=(train_cfg.get("train_subset") or len(data.train or [])) - n_val,  # less the validation split
        val_images=n_val,
        test_images=best[0]["n"],
        epochs=train_cfg["epochs"],
        batch_size=train_cfg["batch_size"],
        precision=train_cfg["precision"],
        cpu=device_name(resolve_device(plan.device)),
        torch=torch.__version__,
        commit=git_commit(),
        command=plan.command(model, len(numbers), device=_cuda_flag(plan)),
        status=status,
    )
    row = with_accuracies(row, numbers, [100 * b["accuracy"] for b in best])
    affine = with_accuracies(row, numbers, [100 * s["affine"] for s in seeds])
    return dataclasses.replace(row, affine_acc_mean=affine.test_acc_mean, affine_acc_std=affine.test_acc_std)


def _cuda_flag(plan: ZooPlan) -> str | None:
    """The device flag of a plan that trains on a GPU ("cuda": its rows' commands say so), else None."""
    return "cuda" if resolve_device(plan.device).type == "cuda" else None


def already_done(plan: ZooPlan, model: str, seeds: list[int]) -> bool:
    """Whether results/ holds this model's trained row at this benchmark's budget and `seeds`."""
    path = plan.results / f"{plan.benchmark}.csv"
    if not path.is_file() or not seeds:
        return False
    numbers = " ".join(map(str, seeds))
    wanted = (model, "defaults", plan.benchmark, plan.precision, numbers, plan.epochs(model))
    return any(
        (r.model, r.config, r.benchmark, r.precision, r.seeds, r.epochs) == wanted and r.test_acc_mean is not None
        for r in read_rows(path)
    )


def not_run_row(plan: ZooPlan, model: str, status: str) -> Row:
    """The row of a model this plan does not train: `status` says why; its command is the one for a GPU."""
    return Row(
        model=model,
        params=sum(p.numel() for p in MODELS[model](**INPUT).parameters()),
        benchmark=plan.benchmark,
        protocol=PROTOCOL,
        epochs=plan.epochs(model),
        batch_size=batch_size_for(model, torch.device("cuda"))[0],  # the batch its GPU command trains at
        precision=plan.precision,
        cpu=cpu_name(),
        torch=torch.__version__,
        commit=git_commit(),
        command=plan.command(model, device="cuda"),
        status=status,
    )


def run_zoo(plan: ZooPlan) -> list[Row]:
    """Every (model, seed) of `plan`; each model's row is written to results/BENCHMARK.csv as soon as it is done
    (for a model whose seeds the CPU cannot take, `ZooPlan.seeds_for`, a row that says so, at once)."""
    rows = []
    for model in plan.models:
        numbers, status = plan.seeds_for(model)
        if already_done(plan, model, numbers):
            print(f"== zoo {plan.benchmark}: {model} is in {plan.results}/{plan.benchmark}.csv already", flush=True)
            continue
        if not numbers:
            print(f"== zoo {plan.benchmark}: {model}: {status}", flush=True)
            row = not_run_row(plan, model, status)
        else:
            if status != "done":
                print(f"== zoo {plan.benchmark}: {model}: {status}", flush=True)
            seeds = [train_seed(plan, model, seed) for seed in numbers]
            row = model_row(plan, model, seeds, numbers, status)
        write_rows(plan.results / f"{plan.benchmark}.csv", [row])
        rows.append(row)
    return rows


def cpu_name() -> str:
    """The host: its CPU model as /proc/cpuinfo names it, its core count and vector/bf16 support (the figures
    depend on them: docs/benchmarks.md), e.g. "Intel(R) Xeon(R) Processor, 2 cores, AVX-512 BF16/AMX"."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    flags = cpu_flags()
    isa = (
        "AVX-512 BF16"
        if "avx512_bf16" in flags
        else "AVX-512"
        if "avx512f" in flags
        else "AVX2"
        if "avx2" in flags
        else ""
    )
    isa += "/AMX" if "amx_bf16" in flags else ""
    return ", ".join(x for x in (model, f"{os.cpu_count()} cores", isa) if x)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the host's CPU as the results data names it."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def git_commit() -> str:
    """capsnet's git commit where it runs from a checkout, else its version."""
    from .._version import __version__

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"capsnet {__version__}"


__all__ = ["BENCHMARKS", "FASHION_EPOCHS", "SAMPLE_EPOCHS", "Benchmark", "ZooPlan", "run_zoo"]
