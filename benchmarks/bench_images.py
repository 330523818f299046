"""A training step on larger colour images: capsnet's routing vs labml's formulation (votes materialized).

    python benchmarks/bench_images.py [--device cpu|cuda] [--setups cifar10,folder64] [--repeats 2]

Setups (random inputs; a step is forward, margin loss (+ reconstruction), backward, Adam):
  cifar10   the paper's §7 CIFAR-10 model as `capsnet reproduce cifar10` builds it: 3×24×24 crops, 64 primary types,
            same padding, leaky routing, no decoder; batch 128
  folder64  a 64×64 RGB image folder with 10 classes and the MNIST architecture (valid padding, 32 primary types,
            decoder reconstructing 3×64×64); batch 32

Variants: "capsnet" (Router's fast path: the GEMM formulation, or the fused CPU kernel where it applies) and
"labml" (the same model with `router.fast = False`: the votes û [B, in, out, out_d] are materialized and routed
with einsums, as in labml's annotated implementation). Both start from the same weights; their first losses are
compared. Peak memory: CUDA max_memory_allocated; CPU the peak RSS growth of a step in a subprocess per variant.
The estimate of :func:`capsnet.models.memory.capsnet_bytes` for the step (less its parameter and Adam share,
which the measured peaks exclude) is printed next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_routing import _status_kib, reset_peak_rss, sync

from capsnet import CapsNet, CapsNetConfig
from capsnet.models.memory import capsnet_bytes
from capsnet.training.build import make_adam

SETUPS = {
    "cifar10": (
        dict(in_channels=3, image_size=24, primary_types=64, padding="same", leaky_routing=True, decoder=False),
        128,
    ),
    "folder64": (dict(in_channels=3, image_size=64), 32),
}


def build(setup: str, variant: str, device: torch.device):
    options, batch = SETUPS[setup]
    torch.manual_seed(0)
    model = CapsNet(config=CapsNetConfig(**options)).to(device).train()
    model.class_caps.fast = variant == "capsnet"
    opt = make_adam(list(model.parameters()), lr=1e-3, device=device)
    g = torch.Generator().manual_seed(1)
    size = model.config.image_size
    images = torch.rand(batch, 3, size, size, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)
    return model, opt, images, labels


def step(model, opt, images, labels) -> float:
    opt.zero_grad(set_to_none=True)
    out = model(images, labels)
    loss, _ = model.loss(out, images, labels)
    loss.backward()
    opt.step()
    return loss.item()


def peak_mib(setup: str, variant: str, device: torch.device) -> float:
    if device.type == "cuda":
        model, opt, images, labels = build(setup, variant, device)
        step(model, opt, images, labels)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(model, opt, images, labels)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    cmd = [sys.executable, os.path.abspath(__file__), "--_probe", setup, variant]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def probe(setup: str, variant: str) -> None:
    model, opt, images, labels = build(setup, variant, torch.device("cpu"))
    step(model, opt, images, labels)  # warm-up: Adam's state exists now
    before = reset_peak_rss()
    step(model, opt, images, labels)
    print(max(0, _status_kib("VmHWM") - before) / 1024)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--setups", default="cifar10,folder64")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--_probe", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._probe:
        probe(*args._probe)
        return 0
    device = torch.device(args.device)
    print(f"device={device} threads={torch.get_num_threads()}; train step (fwd, loss, bwd, Adam), "
          f"median of {args.repeats} after a warm-up")  # fmt: skip
    print(f"{'setup':<9} {'batch':>5} {'labml img/s':>11} {'capsnet img/s':>13} {'labml MiB':>9} {'capsnet MiB':>11} "
          f"{'estimate MiB':>12} {'loss labml':>10} {'loss ours':>10}")  # fmt: skip
    ok = True
    for setup in args.setups.split(","):
        results = {}
        for variant in ("labml", "capsnet"):
            model, opt, images, labels = build(setup, variant, device)
            first = step(model, opt, images, labels)
            times = []
            for _ in range(args.repeats):
                sync(device)
                t0 = time.perf_counter()
                step(model, opt, images, labels)
                sync(device)
                times.append(time.perf_counter() - t0)
            results[variant] = (first, statistics.median(times))
            del model, opt
        mem = {v: float("nan") if args.no_memory else peak_mib(setup, v, device) for v in results}
        options, batch = SETUPS[setup]
        cfg = CapsNetConfig(**options)  # the estimate of the step (the peaks exclude parameters and Adam's state)
        estimate = (capsnet_bytes(cfg, batch, device.type) - capsnet_bytes(cfg, 0, device.type)) / 2**20
        (lf, lt), (cf, ct) = results["labml"], results["capsnet"]
        ok &= abs(lf - cf) <= 1e-4 * max(1.0, abs(lf))
        print(f"{setup:<9} {batch:>5} {batch / lt:>11.1f} {batch / ct:>13.1f} {mem['labml']:>9.0f} "
              f"{mem['capsnet']:>11.0f} {estimate:>12.0f} {lf:>10.6f} {cf:>10.6f}", flush=True)  # fmt: skip
    if not ok:
        print("FAILED: the first-step losses differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
