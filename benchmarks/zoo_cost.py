"""What each registered model costs on this host: training and inference images per second and peak memory, at
the input of the bundled sample (1×28×28, 10 classes), in fp32 and, where the CPU multiplies bf16 natively, bf16;
rows to results/cost.csv.

    python benchmarks/zoo_cost.py [--models capsnet,deepcaps] [--steps 10] [--threads 2] [--results results]

Each (model, precision) is measured in a fresh process, so that its peak memory (the process's maximum resident
set, on CPU) is its own: the model at its defaults, Adam, its default training batch (the model's recipe, else
the CPU's 16); one warm-up step, then the median of --steps timed steps (forward, loss, backward, Adam);
inference in eval mode without gradients at batch 1 and 256 (capsnet.experiments.measure.inference_speed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from capsnet.data.datasets import load_dataset
from capsnet.experiments.measure import inference_speed, peak_memory_mb
from capsnet.experiments.zoo import cpu_name, git_commit
from capsnet.models.recipe import model_input
from capsnet.models.registry import MODELS
from capsnet.results import Row, write_rows
from capsnet.training.hardware import DEFAULT_BATCH, cpu_bf16_native

INFER_BATCH = 256
PROTOCOL = "1x28x28 bundled digits; median of timed steps after a warm-up; peak = the process's max resident set"


def measure(model_name: str, precision: str, steps: int) -> dict[str, float | int]:
    """One (model, precision), in this process."""
    torch.manual_seed(0)
    sample = load_dataset()
    assert sample.train is not None
    model = MODELS[model_name](in_channels=1, image_size=28, n_classes=10).train()
    batch = getattr(type(model), "default_batch_size", None) or DEFAULT_BATCH["cpu"]
    images = model_input(model, sample.train.images[:batch])
    labels = sample.train.labels[:batch]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    times = []
    for k in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = model.loss(model(images, labels), images, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if k:
            times.append(time.perf_counter() - start)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        b1 = inference_speed(model, sample.test, 1, torch.device("cpu"))
        bn = inference_speed(model, sample.test, INFER_BATCH, torch.device("cpu"))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "train": batch / statistics.median(times),
        "b1": b1,
        "bn": bn,
        "peak": peak_memory_mb(torch.device("cpu")),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--precisions", default="fp32,bf16" if cpu_bf16_native() else "fp32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    p.add_argument("--results", default="results")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODEL,PRECISION: measure in this process
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        name, precision = args.one.split(",")
        print(json.dumps(measure(name, precision, args.steps)))
        return 0
    for name in [MODELS.canonical(m) for m in args.models.split(",") if m]:
        for precision in args.precisions.split(","):
            cmd = [sys.executable, __file__, "--one", f"{name},{precision}", "--steps", str(args.steps)]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                print(f"{name} {precision}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            m = json.loads(out.stdout.strip().splitlines()[-1])
            row = Row(
                model=name,
                params=m["params"],
                benchmark="cost",
                protocol=PROTOCOL,
                batch_size=m["batch"],
                precision=precision,
                train_img_s=m["train"],
                infer_img_s_b1=m["b1"],
                infer_img_s_batch=m["bn"],
                infer_batch=INFER_BATCH,
                peak_mem_mb=m["peak"],
                cpu=cpu_name(),
                torch=torch.__version__,
                commit=git_commit(),
                command=f"python benchmarks/zoo_cost.py --models {name} --precisions "
                f"{precision} --steps {args.steps}" + (f" --threads {args.threads}" if args.threads else ""),
                note=f"{torch.get_num_threads() if not args.threads else args.threads} threads",
            )
            write_rows(Path(args.results) / "cost.csv", [row])
            print(
                f"{name:28s} {precision}  train {m['train']:8.1f} img/s (batch {m['batch']})  infer b1 "
                f"{m['b1']:7.1f}  b{INFER_BATCH} {m['bn']:8.1f} img/s  peak {m['peak']:7.0f} MiB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
