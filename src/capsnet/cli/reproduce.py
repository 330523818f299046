"""`capsnet reproduce mnist|multimnist|affnist`: the paper's experiments, one command each."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments.reproduce import format_table, run_experiment, setting_for
from ..training.loop import resolve_device


def register(subparsers) -> None:
    p = subparsers.add_parser("reproduce", help="run one of the paper's experiments (CapsNet vs the baseline CNN)")
    p.add_argument("experiment", help="mnist (Table 1), multimnist (§6) or affnist (§5.2)")
    p.add_argument("--quick", action="store_true", help="a few minutes on a CPU: subsets, 2 epochs, narrower models")
    p.add_argument("--out", default="runs/reproduce", help="output folder (runs and results.json)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:K")
    p.add_argument("--dataset", default=None, help="data set name or MNIST-format folder (default: mnist, or "
                   "mnist-sample with --quick)")  # fmt: skip
    p.add_argument("--affnist", default=None, help="real affNIST test data: .mat files (needs scipy) or an IDX folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue interrupted runs in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setting = setting_for(args.experiment, quick=args.quick, dataset=args.dataset)
    resolve_device(args.device)  # a bad --device fails here, before anything is printed or trained
    print(setting.note, flush=True)
    report = run_experiment(
        args.experiment, quick=args.quick, out=args.out, device=args.device, dataset=args.dataset,
        affnist=args.affnist, seed=args.seed, resume=args.resume, setting=setting,
    )  # fmt: skip
    print(f"\n{args.experiment}: ours vs the paper ({'QUICK run, not the paper setting' if args.quick else 'full'})")
    print(format_table(report))
    print(f"results: {Path(args.out) / args.experiment / 'results.json'}")
    return 0
