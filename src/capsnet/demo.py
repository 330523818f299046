"""`capsnet demo`: the main job on the bundled digits (replaced by a short training run once `train` lands)."""

from __future__ import annotations

import argparse

import torch

from .data import iterate_batches, load_dataset
from .models import CapsNet


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="forward pass of the paper's CapsNet on bundled MNIST digits")
    p.add_argument("--n", type=int, default=8, help="number of test digits (default: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    data = load_dataset("mnist-sample")
    model = CapsNet().eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"CapsNet: {n_params:,} parameters; {len(data.test)} bundled test digits")
    images, labels = next(iterate_batches(data.test, batch_size=max(1, args.n)))
    with torch.no_grad():
        out = model(images)
    print("capsule lengths |v_j| (untrained model), one row per digit:")
    print("label  " + " ".join(f"{j:>5d}" for j in range(out.lengths.shape[1])) + "  predicted")
    for y, row, p in zip(labels.tolist(), out.lengths.tolist(), out.predictions.tolist()):
        print(f"{y:>5d}  " + " ".join(f"{x:5.3f}" for x in row) + f"  {p:>9d}")
    return 0
