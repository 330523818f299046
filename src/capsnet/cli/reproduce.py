"""`capsnet reproduce mnist|multimnist|affnist|cifar10|smallnorb|svhn`: the paper's experiments, one command each;
`capsnet reproduce fashion-mnist`: every model's Fashion-MNIST recipe over several seeds."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..experiments import fashion_mnist, image_sets
from ..experiments.reproduce import EXPERIMENTS, format_table, run_experiment, setting_for
from ..training.hardware import resolve_device


def register(subparsers) -> None:
    p = subparsers.add_parser("reproduce")
    p.add_argument(
        "experiment",
        help="mnist (Table 1), multimnist (§6), affnist (§5.2), or cifar10, smallnorb, "
        "svhn (§7; --quick on generated stand-ins in the real file formats), fashion-mnist (every model's recipe "
        "over --seeds seeds, the test accuracy of the validation-chosen checkpoint), or zoo (every registered model "
        "at its defaults on --benchmark, its row written to --results)",
    )
    p.add_argument("--quick", action="store_true", help=_quick_help())
    p.add_argument("--out", default="runs/reproduce", help="output folder (runs and results.json)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:K")
    p.add_argument(
        "--dataset",
        default=None,
        help="data set name or MNIST-format folder (default: mnist, or mnist-sample with --quick; fashion-mnist: "
        "the folder of its IDX files)",
    )
    p.add_argument("--affnist", default=None, help="real affNIST test data: .mat files (needs scipy) or an IDX folder")
    p.add_argument("--seed", type=int, default=0, help="the (first) seed")
    p.add_argument("--resume", action="store_true", help="continue interrupted runs in --out (fashion-mnist: always)")
    p.add_argument("--epochs", type=int, default=None, help="epochs of every run (default: the experiment's)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size of every run (default: the experiment's)")
    fm = p.add_argument_group(
        "fashion-mnist (with --dataset: the folder of its four IDX files; default: the cache or the system's copy)"
    )
    fm.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a model to run (repeat, or a comma list; default all: {', '.join(fashion_mnist.RECIPES)})",
    )
    fm.add_argument("--seeds", type=int, default=None, help="seeds per model: --seed, --seed + 1, ... (default: 3)")
    zoo = p.add_argument_group("zoo (and --model, --seeds, --seed, --out, --device, --dataset as the data's folder)")
    zoo.add_argument(
        "--benchmark",
        default=None,
        choices=("sample", "fashion-mnist"),
        help="sample (the bundled digits) or fashion-mnist (default sample)",
    )
    zoo.add_argument(
        "--precision",
        default=None,
        choices=("auto", "fp32", "bf16"),
        help="auto (bf16 where the CPU or GPU has it natively), fp32 or bf16 (default auto)",
    )
    zoo.add_argument("--results", default=None, help="the results data folder the rows go to (default results)")
    p.set_defaults(func=run)


FASHION_ONLY = ("model", "seeds")  # options of fashion-mnist and zoo
ZOO_ONLY = ("benchmark", "precision", "results")


def _quick_help() -> str:
    """What --quick does, read from the quick settings themselves."""
    quick = {name: setting_for(name, quick=True) for name in EXPERIMENTS}
    epochs = ", ".join(f"{name} {s.epochs}" for name, s in quick.items())
    pairs = quick["multimnist"].pairs_per_digit
    batch = {s.batch_size for s in quick.values()}
    return (
        f"a few minutes per model on a CPU: the whole bundled mnist-sample (unless --dataset), epochs {epochs}, "
        f"{pairs} MultiMNIST pairs per training digit, batch {'/'.join(map(str, sorted(batch)))}, "
        "narrower models"
    )


def run(args: argparse.Namespace) -> int:
    for name in ("seeds", "epochs", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    zoo_given = [f"--{name}" for name in ZOO_ONLY if getattr(args, name) is not None]
    if args.experiment == "zoo":
        return run_zoo(args)
    if zoo_given:
        raise ConfigError(f"{', '.join(zoo_given)}: options of `capsnet reproduce zoo` only")
    if args.experiment == fashion_mnist.EXPERIMENT:
        return run_fashion(args)
    given = [f"--{name}" for name in FASHION_ONLY if getattr(args, name) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: options of `capsnet reproduce fashion-mnist` and `zoo` only")
    if args.experiment in image_sets.EXPERIMENTS:
        return run_image_set(args)
    setting = _sized(setting_for(args.experiment, quick=args.quick, dataset=args.dataset), args)
    resolve_device(args.device)  # a bad --device fails here, before anything is printed or trained
    print(setting.note, flush=True)
    report = run_experiment(
        args.experiment,
        quick=args.quick,
        out=args.out,
        device=args.device,
        dataset=args.dataset,
        affnist=args.affnist,
        seed=args.seed,
        resume=args.resume,
        setting=setting,
    )
    print(f"\n{args.experiment}: ours vs the paper ({'QUICK run, not the paper setting' if args.quick else 'full'})")
    print(format_table(report))
    print(f"results: {Path(args.out) / args.experiment / 'results.json'}")
    return 0


def run_image_set(args: argparse.Namespace) -> int:
    """The §7 experiments (capsnet.experiments.image_sets): CapsNet only, the paper has no baseline figure there."""
    setting = _sized(
        image_sets.setting_for(args.experiment, quick=args.quick, out=args.out, dataset=args.dataset), args
    )
    resolve_device(args.device)
    print(setting.note, flush=True)
    report = image_sets.run_image_experiment(
        args.experiment,
        quick=args.quick,
        out=args.out,
        device=args.device,
        dataset=args.dataset,
        seed=args.seed,
        resume=args.resume,
        setting=setting,
    )
    print(f"\n{args.experiment}: ours vs the paper ({'QUICK run on stand-in data' if args.quick else 'full'})")
    print(format_table(report))
    print(f"results: {Path(args.out) / args.experiment / 'results.json'}")
    return 0


def _sized(setting: Any, args: argparse.Namespace) -> Any:
    """An experiment's setting with --epochs and --batch-size applied (and said in its note)."""
    changes = {k: getattr(args, k) for k in ("epochs", "batch_size") if getattr(args, k) is not None}
    if not changes:
        return setting
    given = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in changes.items())
    return dataclasses.replace(setting, **changes, note=f"{setting.note}; {given} as given")


def run_fashion(args: argparse.Namespace) -> int:
    """Every chosen model's Fashion-MNIST recipe over the seeds; finished runs are skipped, unfinished continued."""
    if args.affnist is not None:
        raise ConfigError("--affnist: an option of `capsnet reproduce affnist` only")
    if args.dataset is not None and not Path(args.dataset).is_dir():
        raise ConfigError(f"--dataset {args.dataset}: not a folder (fashion-mnist reads its four IDX files from one)")
    models = [m.strip() for arg in args.model for m in arg.split(",") if m.strip()] if args.model else None
    plan = fashion_mnist.Plan(
        models=models or list(fashion_mnist.RECIPES),
        seeds=list(range(args.seed, args.seed + (args.seeds or 3))),
        epochs=args.epochs,
        batch_size=args.batch_size,
        quick=args.quick,
        data_dir=args.dataset,
        device=args.device,
    )
    resolve_device(args.device)
    for model in plan.models:
        config = plan.train_config(model, plan.seeds[0], fashion_mnist.run_dir(args.out, model, plan.seeds[0]))
        print(
            f"{model}: {len(plan.seeds)} seed(s) x {config.epochs} epochs, batch {config.batch_size}, augment "
            f"{config.augment}" + (" (QUICK: a subset, narrow models)" if plan.quick else ""),
            flush=True,
        )
    report = fashion_mnist.run_fashion_mnist(plan, out=args.out)
    print()
    print(fashion_mnist.format_markdown(report))
    print(f"results: {Path(args.out) / fashion_mnist.EXPERIMENT / 'results.json'} (and results.md)")
    return 0


def run_zoo(args: argparse.Namespace) -> int:
    """Every chosen model at its defaults on one benchmark, over the seeds; its row goes to results/BENCHMARK.csv."""
    from ..experiments import zoo
    from ..models.registry import MODELS

    for name in ("quick", "affnist", "epochs", "batch_size"):
        if getattr(args, name) not in (None, False):
            raise ConfigError(
                f"--{name.replace('_', '-')}: not an option of `capsnet reproduce zoo` (its budgets are "
                "stated per benchmark)"
            )
    models = [m.strip() for arg in args.model for m in arg.split(",") if m.strip()] if args.model else list(MODELS)
    plan = zoo.ZooPlan(
        benchmark=args.benchmark or "sample",
        models=models,
        seeds=list(range(args.seed, args.seed + (args.seeds or 3))),
        out=Path(args.out),
        precision=args.precision or "auto",
        device=args.device,
        data_dir=args.dataset,
        results=Path(args.results or "results"),
        progress=sys.stdout.isatty(),
    )
    plan.results.mkdir(parents=True, exist_ok=True)  # an unusable --results fails here, before anything trains
    if not os.access(plan.results, os.W_OK):
        raise PermissionError(errno.EACCES, "Permission denied", str(plan.results))
    for row in zoo.run_zoo(plan):
        if row.test_acc_mean is None:
            print(f"{row.model}: {row.status}; on a GPU: {row.command}")
            continue
        print(
            f"{row.model}: {row.test_acc_mean:.2f} ± {row.test_acc_std:.2f}% test ({row.test_acc}), affine "
            f"{row.affine_acc_mean:.2f}%, {row.epochs} epochs, {row.precision}"
            + ("" if row.status == "done" else f" ({row.status})")
        )
    print(f"results: {plan.results / (plan.benchmark + '.csv')}")
    return 0
