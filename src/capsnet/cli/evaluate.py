"""`capsnet evaluate`: accuracy, per-class accuracy and the confusion matrix of a trained model."""

from __future__ import annotations

import argparse
import json

from ..training.evaluate import evaluate_checkpoint


def register(subparsers) -> None:
    p = subparsers.add_parser("evaluate", help="accuracy, per-class accuracy and confusion matrix of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="run folder (uses best/) or save_pretrained folder")
    p.add_argument("--dataset", default="mnist-sample", help="data set name or folder (default: mnist-sample)")
    p.add_argument("--data-dir", default=None, help="folder with MNIST-format IDX files")
    p.add_argument("--split", choices=["test", "train"], default="test")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    r = evaluate_checkpoint(
        args.checkpoint, dataset=args.dataset, data_dir=args.data_dir, split=args.split,
        batch_size=args.batch_size, device=args.device,
    )  # fmt: skip
    if args.json:
        print(json.dumps(r))
        return 0
    k = len(r["per_class"])
    print(f"{r['dataset']} {r['split']}: accuracy {r['accuracy']:.4f} ({r['n']} images), "
          f"error {100 * (1 - r['accuracy']):.2f}%")  # fmt: skip
    print("per-class accuracy: " + "  ".join(f"{j}:{a:.3f}" for j, a in enumerate(r["per_class"])))
    print("confusion matrix (rows: true, columns: predicted)")
    print("      " + "".join(f"{j:>6d}" for j in range(k)))
    for i, row in enumerate(r["confusion"]):
        print(f"{i:>6d}" + "".join(f"{c:>6d}" for c in row))
    return 0
