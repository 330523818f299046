"""The trainability suite's figures: every registered model at its defaults on each synthetic case
(capsnet.data.synthetic), trained as `capsnet train --dataset FOLDER` trains it, over seeds; rows to
results/trainability.csv.

    python benchmarks/trainability.py [--models capsnet,deepcaps] [--cases shapes,textures] [--seeds 3]
        [--epochs 10] [--stop-at-val-acc 1.0] [--option NAME=VALUE ...] [--results results] [--work DIR]

Each case is written once as train/ and test/ class folders of PNG files under --work; each run holds out its
validation split from train/, chooses best/ on it (val_loss), and scores test/ once. The row gives every seed's
test accuracy of best/. `--option` sets a field of the model's config (what `capsnet train --p-model skm` sets):
the row's config names it, and its runs have a folder of their own. `--stop-at-val-acc` ends each run after the
first epoch whose validation accuracy reaches it (`capsnet train --stop-at-val-acc`): the row's epochs are then a
budget, its note gives the epochs each seed trained. tests/test_trainability.py holds the same cases to a stated
accuracy in `make test`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from capsnet.config import from_dict, parse_option
from capsnet.data.synthetic import CASES, SUITE_EPOCHS, write_case
from capsnet.errors import ConfigError
from capsnet.experiments.zoo import device_name, git_commit
from capsnet.models.registry import MODELS
from capsnet.results import Row, with_accuracies, write_rows
from capsnet.results_tables import STOPPED
from capsnet.training.api import train
from capsnet.training.config import TrainConfig
from capsnet.training.hardware import resolve_device


def case_folder(case: str, work: Path) -> Path:
    """The case's class folders under `work` (written on first use)."""
    return write_case(case, work / case)


def option(text: str) -> tuple[str, Any]:
    """`capsnet.config.parse_option` ("p-model=skm" -> ("p_model", "skm")), as an argparse type."""
    try:
        return parse_option(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def label(options: dict[str, Any]) -> str:
    """The options as `capsnet train` flags ("--p-model skm"), or "defaults"."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items()) or "defaults"


def run_folder(model: str, case: str, seed: int, options: dict[str, Any], *, work: Path) -> Path:
    """runs/CASE/MODEL/seed-N at the model's defaults; runs/CASE/MODEL/FLAGS/seed-N with options."""
    folder = work / "runs" / case / model
    if options:
        folder /= label(options).lstrip("-").replace(" --", "-").replace(" ", "-")
    return folder / f"seed-{seed}"


def recorded(folder: Path) -> tuple[int, str, int]:
    """(the passes over the training images an epoch of the run in `folder` took, its augmentation, the epochs it
    trained): the first two unset in the run's command and chosen from the data (capsnet.training.config
    .MIN_EPOCH_STEPS, capsnet.data.colour), as its config.json records them; the epochs as its test.json does."""
    meta = json.loads((folder / "config.json").read_text())
    trained = json.loads((folder / "test.json").read_text())["epochs"]
    return int(meta["train"].get("epoch_repeats") or 1), str(meta.get("augment", "?")), int(trained)


def run(
    model: str, case: str, seed: int, options: dict[str, Any], *, epochs: int, stop_at: float | None, work: Path
) -> float:
    """Test accuracy of best/ of one `capsnet train --dataset FOLDER --model MODEL --seed SEED` run (with the
    model config's `options`)."""
    out = run_folder(model, case, seed, options, work=work)
    folder = case_folder(case, work)
    resume = (out / "state.pt").is_file()
    config = TrainConfig(
        dataset=str(folder),
        model=model,
        seed=seed,
        epochs=epochs,
        stop_at_val_acc=stop_at,
        out=str(out),
        progress=False,
        tensorboard=False,
        resume=resume,
    )
    accuracy = train(config, dict(options)).best_test_acc  # (the options set; the rest as `capsnet train` has them)
    if accuracy is None:
        raise RuntimeError(f"{out}: the run ended without a test figure")
    return accuracy


def case_row(
    model: str, case: str, options: dict[str, Any], *, epochs: int, seeds: int, stop_at: float | None = None
) -> Row:
    """The row of one model on one case, before its accuracies."""
    n_train, n_test = CASES[case].n_train, CASES[case].n_test
    n_classes = len(CASES[case].classes)
    n_val = round(0.1 * n_classes * n_train)  # TrainConfig's val_fraction
    flags = "".join(f" --option {k}={json.dumps(v)}" for k, v in options.items())
    setting = f"with {label(options)}" if options else "at the model's defaults"
    stopping = f", {STOPPED} >= {stop_at}" if stop_at is not None else ""  # (how docs/results.md tells them)
    flags += f" --stop-at-val-acc {stop_at}" if stop_at is not None else ""
    return Row(
        model=model,
        config=label(options),
        benchmark=f"trainability:{case}",
        protocol=f"capsnet train --dataset FOLDER {setting}{stopping}; best/ on val_loss, test/ scored once",
        train_images=n_classes * n_train - n_val,
        val_images=n_val,
        test_images=n_classes * n_test,
        epochs=epochs,
        cpu=device_name(resolve_device(TrainConfig.device)),  # where `capsnet train` runs by default
        commit=git_commit(),
        command=f"python benchmarks/trainability.py --models {model} --cases {case} --seeds {seeds}{flags}",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list (default: every registered model)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=SUITE_EPOCHS)
    p.add_argument("--stop-at-val-acc", type=float, default=None, help="end a run at this validation accuracy")
    p.add_argument("--option", type=option, action="append", default=[], help="NAME=VALUE of the model's config")
    p.add_argument("--results", default="results", help="the results data folder")
    p.add_argument("--work", default=None, help="where the case folders and runs go (default: a temporary folder)")
    args = p.parse_args()
    models = [MODELS.canonical(m) for m in args.models.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"trainability: error: unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="capsnet-trainability-"))
    seeds = list(range(args.seeds))
    options = dict(args.option)
    try:  # every model's config takes the options, checked before anything trains
        for model in models:
            from_dict(MODELS[model].config_class, options, what=f"--model {model}")
    except ConfigError as e:
        print(f"trainability: error: {e}", file=sys.stderr)
        return 2
    for case in cases:
        for model in models:
            start = time.perf_counter()
            stop_at = args.stop_at_val_acc
            accuracies = [
                100 * run(model, case, seed, options, epochs=args.epochs, stop_at=stop_at, work=work) for seed in seeds
            ]
            row = case_row(model, case, options, epochs=args.epochs, stop_at=stop_at, seeds=args.seeds)
            row = with_accuracies(row, seeds, accuracies)
            chosen = [recorded(run_folder(model, case, s, options, work=work)) for s in seeds]
            repeats, augment = sorted({r for r, _, _ in chosen}), sorted({a for _, a, _ in chosen})
            note = f"{'/'.join(map(str, repeats))} passes over the training images an epoch"
            note += f"; augment {'/'.join(augment)}"
            if stop_at is not None:
                note += f"; epochs trained {'/'.join(str(e) for _, _, e in chosen)}"
            row = replace(row, note=note)
            write_rows(Path(args.results) / "trainability.csv", [row])
            took = time.perf_counter() - start
            figure = f"{row.test_acc_mean:6.2f} ± {row.test_acc_std:5.2f}% ({row.test_acc})"
            print(f"{case:13s} {model:28s} {figure} {took:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
