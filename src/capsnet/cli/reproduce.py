"""`capsnet reproduce mnist|multimnist|affnist`: the paper's experiments, one command each."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments import image_sets
from ..experiments.reproduce import EXPERIMENTS, format_table, run_experiment, setting_for
from ..training.loop import resolve_device


def register(subparsers) -> None:
    p = subparsers.add_parser("reproduce", help="run one of the paper's experiments (CapsNet vs the baseline CNN)")
    p.add_argument(
        "experiment",
        help="mnist (Table 1), multimnist (§6), affnist (§5.2), or cifar10, smallnorb, "
        "svhn (§7; --quick on generated stand-ins in the real file formats)",
    )
    p.add_argument("--quick", action="store_true", help=_quick_help())
    p.add_argument("--out", default="runs/reproduce", help="output folder (runs and results.json)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:K")
    p.add_argument(
        "--dataset",
        default=None,
        help="data set name or MNIST-format folder (default: mnist, or mnist-sample with --quick)",
    )
    p.add_argument("--affnist", default=None, help="real affNIST test data: .mat files (needs scipy) or an IDX folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue interrupted runs in --out")
    p.set_defaults(func=run)


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
    if args.experiment in image_sets.EXPERIMENTS:
        return run_image_set(args)
    setting = setting_for(args.experiment, quick=args.quick, dataset=args.dataset)
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
    setting = image_sets.setting_for(args.experiment, quick=args.quick, out=args.out, dataset=args.dataset)
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
