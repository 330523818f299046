"""`capsnet evaluate`: accuracy, per-class accuracy and the confusion matrix of a trained model."""

from __future__ import annotations

import argparse
import json

from .checkpoints import add_model_arguments, model_paths


def register(subparsers) -> None:
    p = subparsers.add_parser("evaluate")
    add_model_arguments(
        p,
        repeat="repeat them to evaluate an ensemble that averages the capsule lengths (the "
        "paper's CIFAR-10 ensemble, §7)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="data set name or folder (default: the one the checkpoint was trained on, from its run's "
        "config.json or the shipped weights' card)",
    )
    p.add_argument("--data-dir", default=None, help="folder holding the data set's files")
    p.add_argument("--split", choices=["test", "train"], default="test")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..inference import evaluate_checkpoint
    from ..training.checkpoint_data import describe_scored

    paths = model_paths(args)
    r = evaluate_checkpoint(
        paths if len(paths) > 1 else paths[0],
        dataset=args.dataset,
        data_dir=args.data_dir,
        split=args.split,
        batch_size=args.batch_size,
        device=args.device,
    )
    if args.json:
        print(json.dumps(r))
        return 0
    k = len(r["per_class"])
    for note in r.get("conversions", ()):
        print(f"data: {note}")
    for entry in r["scored"]:
        print(f"scored {describe_scored(entry)}")
    print(
        f"{r['dataset']} {r['split']}: accuracy {r['accuracy']:.4f} ({r['n']} images), "
        f"error {100 * (1 - r['accuracy']):.2f}%"
    )
    if len(paths) > 1:
        print(f"ensemble of {len(paths)} checkpoints (capsule lengths averaged)")
    names = r.get("class_names") or [str(j) for j in range(k)]
    print("per-class accuracy: " + "  ".join(f"{n}:{a:.3f}" for n, a in zip(names, r["per_class"])))
    if any(n != str(j) for j, n in enumerate(names)):
        print("classes: " + "  ".join(f"{j}={n}" for j, n in enumerate(names)))
    print("confusion matrix (rows: true, columns: predicted)")
    print("      " + "".join(f"{j:>6d}" for j in range(k)))
    for i, row in enumerate(r["confusion"]):
        print(f"{i:>6d}" + "".join(f"{c:>6d}" for c in row))
    return 0
