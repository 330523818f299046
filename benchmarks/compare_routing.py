"""Every model and CapsNet routing option trained with the same budget, then compared on the same test images.

    python benchmarks/compare_routing.py [--dataset mnist-sample] [--epochs 10] [--train-subset N]
        [--test-subset N] [--only NAME,...] [--device cpu] [--out runs/compare-routing]

Entries: the paper's CapsNet with each `--routing` (dynamic, self-attention, inverted-attention, self-routing)
and every other model `capsnet models` lists, each with its own defaults (architecture, learning rate and decay).
Each entry trains in a fresh subprocess (so its peak memory is its own) with `capsnet.training.train`, then its
best checkpoint is measured:

- test accuracy (best epoch), parameters, training images/s (mean over epochs), peak memory (CPU: the process's
  maximum resident set size; CUDA: torch.cuda.max_memory_allocated);
- routing activity: how far the class capsules' routing weights move from uniform (mean over test images and
  input capsules of max_j |w_ij − 1/n| in units of 1/n; 0 = uniform), and, for iterative routing, test accuracy
  with 1 and with 3 iterations (same weights);
- accuracy on the test images transformed by capsnet.data.random_affine (rotation ±15°, scale 0.9–1.1, shear ±10°,
  translation ±10%; a fixed seed), none of which training saw beyond its ±2 px shifts.

Prints a Markdown table (and writes it to OUT/compare.md, with each entry's JSON in OUT/NAME.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from capsnet.data import Split, load_dataset
from capsnet.data.augment import random_affine
from capsnet.data.split import to_float
from capsnet.fileio import atomic_write_bytes, atomic_write_json
from capsnet.models.pretrained import load_pretrained
from capsnet.models.registry import MODELS
from capsnet.routing import weight_spread

ROUTINGS = ("dynamic", "self-attention", "inverted-attention", "self-routing")


def entries() -> dict[str, tuple[str, dict]]:
    """Entry name -> (registered model, model config overrides)."""
    out = {f"capsnet --routing {r}": ("capsnet", {"routing": r}) for r in ROUTINGS}
    out.update({name: (name, {}) for name in MODELS if name != "capsnet"})
    return out


def set_iterations(model, r: int) -> bool:
    """Set the routing iterations of the class capsules; False where the routing is not iterative."""
    method = getattr(model.config, "routing", None) or getattr(model, "routing_method", None)
    if method == "dynamic" or (method == "inverted-attention" and hasattr(model, "class_caps")):
        model.class_caps.iterations = r
        return True
    if method == "inverted-attention" and hasattr(model.config, "routing_iterations"):  # concurrent routing
        model.config.routing_iterations = r
        return True
    if method == "em":  # EMCapsNet: every EM layer
        for layer in (model.caps1, model.caps2, model.classes):
            layer.iterations = r
        return True
    return False


@torch.no_grad()
def measure(model, test: Split, batch: int = 100) -> dict:
    """Accuracy and mean routing-weight spread over `test` (images uint8 or float), on the model's device."""
    correct, spread, n = 0, None, 0
    device = next(model.parameters()).device
    for i in range(0, len(test), batch):
        x, y = to_float(test.images[i : i + batch]).to(device), test.labels[i : i + batch].to(device)
        out = model(x, return_coupling=True)
        correct += int((out.predictions == y).sum())
        if out.coupling is not None:
            spread = (spread or 0.0) + weight_spread(out.coupling) * len(y)
        n += len(y)
    return {"accuracy": correct / n, "spread": None if spread is None else spread / n}


def run_one(args: argparse.Namespace, name: str) -> dict:
    from capsnet.training.hardware import resolve_device
    from capsnet.training.loop import TrainConfig, train

    model_name, overrides = entries()[name]
    out = Path(args.out) / name.replace(" ", "_").replace("--", "")
    config = TrainConfig(model=model_name, dataset=args.dataset, epochs=args.epochs, train_subset=args.train_subset,
                         test_subset=args.test_subset, device=args.device, out=str(out), progress=False,
                         tensorboard=False, seed=args.seed, resume=(out / "state.pt").is_file())  # fmt: skip
    model_config = MODELS[model_name].config_class(**overrides) if overrides else None
    result = train(config, model_config)
    model = load_pretrained(out / "best").to(resolve_device(args.device)).eval()
    data = load_dataset(args.dataset)
    test = data.test if args.test_subset is None else Split(data.test.images[: args.test_subset],
                                                            data.test.labels[: args.test_subset])  # fmt: skip
    gen = torch.Generator().manual_seed(1234)
    affine = Split(random_affine(to_float(test.images), degrees=15, scale=(0.9, 1.1), shear=10, translate=0.1,
                                 generator=gen), test.labels)  # fmt: skip
    row = {
        "entry": name, "parameters": sum(p.numel() for p in model.parameters()),
        "test_acc": result.best_test_acc,
        "img_s": sum(r["images_per_s"] for r in result.history) / max(1, len(result.history)),
        "spread": measure(model, test)["spread"], "affine_acc": measure(model, affine)["accuracy"],
    }  # fmt: skip
    if set_iterations(model, 1):
        row["acc_r1"] = measure(model, test)["accuracy"]
        set_iterations(model, 3)
        row["acc_r3"] = measure(model, test)["accuracy"]
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        row["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        row["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return row


def fmt(row: dict) -> str:
    def pct(key):
        return f"{100 * row[key]:.2f}" if row.get(key) is not None else "–"

    spread = f"{row['spread']:.2f}" if row.get("spread") is not None else "–"
    return (f"| {row['entry']} | {row['parameters']:,} | {pct('test_acc')} | {row['img_s']:.0f} | "
            f"{row['peak_mb']:.0f} | {spread} | {pct('acc_r1')} / {pct('acc_r3')} | {pct('affine_acc')} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="mnist-sample")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--train-subset", type=int, default=None)
    ap.add_argument("--test-subset", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated substrings of the entry names to run")
    ap.add_argument("--out", default="runs/compare-routing")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one entry in this process
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args, args.one)))
        return 0
    names = [n for n in entries() if not args.only or any(s in n for s in args.only.split(","))]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    header = ("| model / routing | parameters | test acc % | train img/s | peak MB | weight spread | "
              "acc r=1 / r=3 % | affine acc % |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    lines = [f"{args.dataset}, {args.epochs} epochs, train subset {args.train_subset or 'all'}, test subset "
             f"{args.test_subset or 'all'}, device {args.device}", "", header]  # fmt: skip
    print("\n".join(lines), flush=True)
    failed = False
    for name in names:
        argv = [sys.executable, os.path.abspath(__file__), "--one", name, *sys.argv[1:]]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"| {name} | failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode} |")
            failed = True
            continue
        row = json.loads(r.stdout.strip().splitlines()[-1])
        atomic_write_json(Path(args.out) / f"{name.replace(' ', '_').replace('--', '')}.json", row)
        lines.append(fmt(row))
        print(lines[-1], flush=True)
    atomic_write_bytes(Path(args.out) / "compare.md", ("\n".join(lines) + "\n").encode())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
