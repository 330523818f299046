"""Training throughput over whole epochs: `capsnet train` vs a plain training loop over labml's formulation.

    python benchmarks/bench_epoch.py [--batch-size 64] [--precision fp32|bf16] [--repeats 2] [--device cpu|cuda]
                                     [--dataset mnist-sample|fashion-mnist|mnist|FOLDER]

Both train on the same data (by default the bundled MNIST sample, 6,000 digits; a 60,000-image set such as
fashion-mnist times a full-MNIST-sized epoch) at the same batch size, one epoch per measurement, alternating
labml, capsnet, labml, capsnet, ... so drift on a shared machine hits both alike.

- labml: the model of labml's annotated CapsNet, the article capsnet started from (benchmarks/bench_train.py's
  LabmlCapsNet: einsum votes, softmax over the output capsules, r = 3) in a plain loop: shuffle, index a batch,
  the same ±2 px random shift, forward, margin + reconstruction loss, backward, Adam. Always fp32 (it is the
  reference). images/s = images / loop seconds.
- capsnet: `capsnet.training.train` with the defaults except the batch size and `--precision` (no progress bar, no
  TensorBoard), for one epoch; images/s is the figure it writes to summary.csv (training steps only, the test
  pass after the epoch excluded — as for the labml loop).

The median of the per-run ratios is the figure the speed issue targets (fp32 >= 1.3x, bf16 >= 2.0x at batch 64).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_routing import sync
from bench_train import LabmlCapsNet, labml_loss

from capsnet import CapsNet
from capsnet.data import load_dataset
from capsnet.data.augment import random_shift
from capsnet.errors import CapsNetError
from capsnet.training.api import train
from capsnet.training.config import TrainConfig


def labml_epoch(batch_size: int, device: torch.device, seed: int, dataset: str) -> float:
    """One epoch of the plain labml loop; returns images/s."""
    torch.manual_seed(seed)
    model = LabmlCapsNet().to(device).train()
    # Same starting point as capsnet's (its weights; labml's own std-1 W would not train).
    model.load_state_dict({k: v for k, v in CapsNet().state_dict().items() if k in model.state_dict()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    split = load_dataset(dataset).train
    order = torch.randperm(len(split))
    gen = torch.Generator(device=device).manual_seed(seed)
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        take = order[start : start + batch_size]
        images = split.images[take].to(device).float().div_(255.0)
        labels = split.labels[take].to(device)
        images = random_shift(images, 2, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = labml_loss(*model(images, labels), images, labels)
        loss.backward()
        opt.step()
        loss.item()  # a real loop logs its loss
    sync(device)
    return len(order) / (time.perf_counter() - t0)


def capsnet_epoch(
    batch_size: int, device: torch.device, precision: str, seed: int, dataset: str, subset: int | None = None
) -> dict[str, float]:
    """One epoch of `capsnet train`; returns its summary.csv row (images_per_s, seconds, ...)."""
    with tempfile.TemporaryDirectory(prefix="capsnet-bench-") as out:
        cfg = TrainConfig(
            dataset=dataset,
            batch_size=batch_size,
            epochs=1,
            precision=precision,
            device=str(device),
            seed=seed,
            out=out,
            progress=False,
            tensorboard=False,
            train_subset=subset,
            test_subset=subset,
        )
        result = train(cfg)
    return result.history[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=2, help="epochs measured per variant")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dataset", default="mnist-sample", help="data set name or MNIST-format folder")
    args = p.parse_args()
    if args.repeats < 1 or args.batch_size < 1:
        p.error("--repeats and --batch-size must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    try:
        load_dataset(args.dataset)  # a wrong name or folder fails here, in one line, before any timing
    except CapsNetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device={device} threads={torch.get_num_threads()} batch={args.batch_size} "
        f"capsnet precision={args.precision} (labml loop fp32); one epoch of {args.dataset} per run"
    )
    # Warm-up on a few batches: builds/loads the routing kernel and fills the allocator, outside the timings.
    capsnet_epoch(args.batch_size, device, args.precision, seed=0, dataset=args.dataset, subset=4 * args.batch_size)
    rates: dict[str, list[float]] = {"labml": [], "capsnet": []}
    for r in range(args.repeats):
        rates["labml"].append(labml_epoch(args.batch_size, device, seed=r, dataset=args.dataset))
        row = capsnet_epoch(args.batch_size, device, args.precision, seed=r, dataset=args.dataset)
        rates["capsnet"].append(row["images_per_s"])
        print(
            f"run {r + 1}: labml {rates['labml'][-1]:.1f} img/s, capsnet {rates['capsnet'][-1]:.1f} img/s "
            f"({row['seconds']:.1f} s per epoch), ratio {rates['capsnet'][-1] / rates['labml'][-1]:.2f}x",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in rates.items()}
    # Each run pairs two back-to-back epochs, so the median of the per-run ratios is the figure that holds up
    # when the machine's speed drifts between runs.
    ratio = statistics.median(c / s for s, c in zip(rates["labml"], rates["capsnet"]))
    print(f"{'batch':>5} {'precision':>9} {'labml img/s':>11} {'capsnet img/s':>14} {'speed-up':>9}")
    print(f"{args.batch_size:>5} {args.precision:>9} {med['labml']:>11.1f} {med['capsnet']:>14.1f} {ratio:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
