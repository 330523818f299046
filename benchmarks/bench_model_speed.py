"""Training throughput of any registered model (images/s of a whole step: forward, loss, backward, Adam) by batch
size and thread count, and the epoch time it implies.

    python benchmarks/bench_model_speed.py [--model hvc-capsnet] [--options '{"channels": [16, 24, 32, 40, 48,
        56, 64, 72, 80]}'] [--batch-sizes 16,32,64,128] [--threads 1,2] [--repeats 3] [--epoch-images 60000]
        [--device cpu|cuda]

Inputs are random 1×28×28 images (or the --options' in_channels / image_size) with random labels; each figure is
the median of --repeats timed steps after one warm-up step. The last column is the time of an epoch of
--epoch-images training images at that speed (60,000: Fashion-MNIST or MNIST; 5,400: the bundled sample's
training share under a 0.1 validation split), the test pass excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from capsnet.models.inputs import image_hw
from capsnet.models.registry import MODELS


def step_seconds(model, optimizer, images, labels, repeats: int) -> float:
    """Median seconds of one training step over `repeats` timed steps (after a warm-up step)."""
    times = []
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        loss, _ = model.loss(model(images, labels), images, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if images.device.type == "cuda":
            torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hvc-capsnet", choices=list(MODELS))
    p.add_argument("--options", default="{}", help="model config options as a JSON object")
    p.add_argument("--batch-sizes", default="16,32,64,128")
    p.add_argument("--threads", default="1,2", help="CPU thread counts (torch.set_num_threads)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epoch-images", type=int, default=60_000)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    try:
        options = json.loads(args.options)
        batches = [int(b) for b in args.batch_sizes.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA GPU here")
    except ValueError as e:
        print(f"bench_model_speed: error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = MODELS[args.model](**options).to(device).train()
    cfg = model.config
    h, w = image_hw(cfg.image_size)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    print(f"{args.model} {json.dumps(options)}: {n_params:,} parameters; {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}")  # fmt: skip
    print(f"\n| threads | batch | train img/s | epoch of {args.epoch_images:,} images |\n|---|---|---|---|")
    for t in threads if device.type == "cpu" else [torch.get_num_threads()]:
        torch.set_num_threads(t)
        for b in batches:
            images = torch.rand(b, cfg.in_channels, h, w, device=device)
            labels = torch.randint(0, cfg.n_classes, (b,), device=device)
            rate = b / step_seconds(model, optimizer, images, labels, args.repeats)
            minutes = args.epoch_images / rate / 60
            print(f"| {t} | {b} | {rate:,.0f} | {minutes:.1f} min |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
