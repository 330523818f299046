"""`capsnet demo` (what `make demo` runs): train the paper's CapsNet on the bundled digits, evaluate, show outputs.

A few epochs on the 6,000 bundled training digits take minutes on a laptop CPU. Running it again continues
the same run folder (nothing already written is lost) and re-evaluates.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser("demo")
    p.add_argument("--epochs", type=int, default=3, help="epochs (default: 3)")
    p.add_argument("--out", default="runs/demo", help="run folder (default: runs/demo)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:K (default: auto)")
    p.add_argument("--no-figures", dest="figures", action="store_false", help="skip the figures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..inference import evaluate_checkpoint
    from ..training.api import train
    from ..training.checkpoint import STATE_NAME, load_state
    from ..training.config import TrainConfig
    from ..training.hardware import resolve_device

    if args.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {args.epochs}")
    out = Path(args.out)
    resume = (out / STATE_NAME).is_file()
    if resume and load_state(out)["epoch"] >= args.epochs:
        print(f"{out} already holds a finished {args.epochs}-epoch demo run; evaluating it")
    else:
        print(
            "training the paper's CapsNet on the bundled MNIST sample (5,400 train / 600 validation / 2,000 test) "
            f"for {args.epochs} epochs -> {out}/" + (" (resuming)" if resume else "")
        )
        result = train(TrainConfig(epochs=args.epochs, out=str(out), resume=resume, device=args.device))
        if result.interrupted:
            return 130
    r = evaluate_checkpoint(out, dataset="mnist-sample", device=str(resolve_device(args.device)))
    print(
        f"test accuracy of {out}/best (the epoch chosen on validation): {r['accuracy']:.4f} on {r['n']} bundled "
        f"test digits (error {100 * (1 - r['accuracy']):.2f}%)"
    )
    figures = _figures(out, args) if args.figures else []
    print("outputs:")
    print(f"  {out}/best/, {out}/last/   weights (model.safetensors + config.json; CapsNet.from_pretrained)")
    print(f"  {out}/summary.csv          per-epoch loss, accuracy, learning rate, images/s")
    print(f"  {out}/tb/                  TensorBoard scalars (tensorboard --logdir {out}/tb)")
    for path in figures:
        print(f"  {path}")
    print(f"next: capsnet evaluate --checkpoint {out} | capsnet predict --checkpoint {out} IMAGE.png")
    return 0


def _figures(out: Path, args: argparse.Namespace) -> list[Path]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("(figures skipped: pip install 'capsnet[viz]' for matplotlib)")
        return []
    from ..viz.figures import visualize

    return list(visualize(out, out / "figures", dataset="mnist-sample", log=lambda _: None).values())
