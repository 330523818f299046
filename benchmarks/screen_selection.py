"""Selection screen: which checkpoint a validation criterion picks, and what that checkpoint scores on test.

    python benchmarks/screen_selection.py run --seeds 0 1 2 --out runs/screen/capsnet
    python benchmarks/screen_selection.py run --model efficient-capsnet --ema 0.999 --seeds 0 1 --out runs/screen/eff
    python benchmarks/screen_selection.py report runs/screen/capsnet

`run` trains one run per seed (`capsnet train`'s defaults on the bundled sample unless told otherwise) and keeps
the state.pt of every epoch (each epoch's raw weights, and with `--ema` its averaged weights). Every kept
checkpoint is then scored on the test split into `OUT/seedK/screen.json`, next to the run's validation history.

`report` applies each selection rule to the validation history only (the library's own rule,
capsnet.training.selection) and prints, per rule, the chosen epoch and the test accuracy of that checkpoint:
each seed's and their mean ± std. The test figures of the checkpoints no rule chose are never reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from capsnet.models.pretrained import load_pretrained
from capsnet.training import distributed as dist_utils
from capsnet.training.api import train
from capsnet.training.classification import ClassificationTask
from capsnet.training.config import TrainConfig
from capsnet.training.selection import Monitor

RULES = ("val_accuracy", "val_loss", "val_accuracy,val_loss")


def run_seed(args: argparse.Namespace, seed: int) -> None:
    out = Path(args.out) / f"seed{seed}"
    if (out / "screen.json").is_file():
        return
    if out.exists():
        shutil.rmtree(out)
    config = TrainConfig(model=args.model, epochs=args.epochs, seed=seed, out=str(out), device="cpu",
                         progress=False, tensorboard=False, ema=args.ema, val_fraction=args.val_fraction)  # fmt: skip
    kept = out / "epochs"
    seen = {"mtime": None}

    def keep(step: int) -> bool:  # at each epoch's first step, state.pt is the end of the epoch before
        state = out / "state.pt"
        mtime = state.stat().st_mtime_ns if state.is_file() else None
        if mtime != seen["mtime"] and mtime is not None:
            kept.mkdir(exist_ok=True)
            shutil.copy(state, kept / f"{len(list(kept.iterdir())) + 1}.pt")
            seen["mtime"] = mtime
        return False

    t0 = time.time()
    result = train(config, on_step=keep)
    wall = time.time() - t0
    kept.mkdir(exist_ok=True)
    shutil.copy(out / "state.pt", kept / f"{args.epochs}.pt")
    task = ClassificationTask.from_config(config)
    model = load_pretrained(out / "last")
    tested: dict[str, dict[str, float]] = {}
    for epoch in range(1, args.epochs + 1):
        saved = torch.load(kept / f"{epoch}.pt", weights_only=True)
        for weights in ("raw", "ema"):
            state = saved["model"] if weights == "raw" else saved.get("ema", {}).get("weights")
            if state is None:
                continue
            model.load_state_dict(state)
            scores = task.evaluate(model, split="test", batch_size=250, device="cpu", dist=dist_utils.DistInfo())
            tested[f"{weights}{epoch}"] = {"accuracy": scores["accuracy"], "loss": scores["loss"]}
    screen = {"model": args.model, "seed": seed, "epochs": args.epochs, "ema": args.ema, "wall_s": wall,
              "history": result.history, "test": tested, "cpu": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads()}  # fmt: skip
    (out / "screen.json").write_text(json.dumps(screen, indent=1))
    shutil.rmtree(kept)


def choose(history: list[dict], rule: str, candidates: tuple[str, ...]) -> str:
    """The checkpoint (`raw3`, `ema2`, ...) that `rule` picks from the validation history alone."""
    monitor = Monitor.parse(rule)
    best: dict = {}
    for row in history:
        for weights in candidates:
            prefix = "" if weights == "raw" else "ema_"
            if f"{prefix}val_acc" not in row:
                continue
            scores = {"accuracy": row[f"{prefix}val_acc"], "loss": row[f"{prefix}val_loss"]}
            if monitor.better(scores, best.get("scores")):
                best = {"scores": scores, "name": f"{weights}{int(row['epoch'])}"}
    return best["name"]


def report(folder: Path) -> None:
    screens = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*/screen.json"))]
    first = screens[0]
    print(f"# {first['model']}, {first['epochs']} epochs, ema {first['ema']}, seeds "
          f"{[s['seed'] for s in screens]}; {first['cpu']}, {first['threads']} threads; "
          f"wall {sum(s['wall_s'] for s in screens) / 60:.1f} min")  # fmt: skip
    pools = [("raw",)] + ([("raw", "ema"), ("ema",)] if first["ema"] else [])
    for pool in pools:
        for rule in RULES:
            picks = [choose(s["history"], rule, pool) for s in screens]
            accs = [s["test"][p]["accuracy"] for s, p in zip(screens, picks, strict=True)]
            vals = []
            for s, p in zip(screens, picks, strict=True):
                row = s["history"][int(p.removeprefix("raw").removeprefix("ema")) - 1]
                prefix = "ema_" if p.startswith("ema") else ""
                vals.append(row[f"{prefix}val_acc"])
            std = statistics.stdev(accs) if len(accs) > 1 else 0.0
            print(f"{'+'.join(pool):8s} {rule:22s} picks {' '.join(picks):18s} val "
                  f"{' / '.join(f'{100 * v:.2f}' for v in vals)}  test "
                  f"{' / '.join(f'{100 * a:.2f}' for a in accs)}  mean {100 * statistics.mean(accs):.2f} "
                  f"± {100 * std:.2f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="capsnet")
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--ema", type=float, default=None)
    r.add_argument("--val-fraction", type=float, default=0.1)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--out", required=True)
    s = sub.add_parser("report")
    s.add_argument("folder", type=Path)
    args = p.parse_args()
    if args.command == "run":
        os.makedirs(args.out, exist_ok=True)
        for seed in args.seeds:
            run_seed(args, seed)
    report(Path(args.out) if args.command == "run" else args.folder)


if __name__ == "__main__":
    main()
