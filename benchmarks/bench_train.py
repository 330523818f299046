"""One training step of the MNIST CapsNet (capsnet.CapsNet) vs the same model in labml's formulation.

    python benchmarks/bench_train.py [--device cpu|cuda] [--batch-sizes 64,128] [--repeats 5]
                                     [--precision fp32|bf16] [--channels-last]

A step is: forward, margin loss + 0.0005 × summed squared reconstruction error (decoder masked by the true
label), backward, Adam step. Both models start from identical weights (the labml model loads CapsNet's state),
and the losses of their first step are compared. `--precision bf16` runs CapsNet under autocast (the routing
itself stays fp32); labml's always runs in fp32 as the reference. Timings are interleaved medians; peak memory
as in bench_routing.py (CUDA: max_memory_allocated; CPU: peak RSS growth in a subprocess per variant).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_routing import _status_kib, labml_squash, reset_peak_rss, sync

from capsnet import CapsNet
from capsnet.training.build import make_adam


# --- the model in labml's formulation ---------------------------------------------------------------
class LabmlCapsNet(nn.Module):
    """conv1 256 9×9 + ReLU, primary conv 256 9×9 stride 2 → 32×6×6 capsules of 8D, routing einsums → 10×16D,
    decoder 512-1024-784. Parameter names match capsnet.CapsNet, so its state dict loads unchanged."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 256, 9)
        self.primary = nn.Module()
        self.primary.conv = nn.Conv2d(256, 256, 9, stride=2)
        self.class_caps = nn.Module()
        self.class_caps.weight = nn.Parameter(torch.randn(1152, 10, 8, 16))
        self.decoder = nn.Module()
        self.decoder.net = nn.Sequential(
            nn.Linear(160, 512),
            nn.ReLU(inplace=True),
            nn.Linear(512, 1024),
            nn.ReLU(inplace=True),
            nn.Linear(1024, 784),
            nn.Sigmoid(),
        )

    def forward(self, x, labels):
        x = F.relu(self.conv1(x))
        y = self.primary.conv(x)  # [B, 256, 6, 6]
        b = y.shape[0]
        u = labml_squash(y.view(b, 32, 8, 6, 6).permute(0, 1, 3, 4, 2).contiguous().view(b, 1152, 8))
        w = self.class_caps.weight
        u_hat = torch.einsum("ijnm,bin->bijm", w, u)
        logits = torch.zeros(b, 1152, 10, device=x.device)
        for i in range(3):
            c = torch.softmax(logits, dim=2)
            v = labml_squash(torch.einsum("bij,bijm->bjm", c, u_hat))
            if i < 2:
                logits = logits + torch.einsum("bjm,bijm->bij", v, u_hat)
        lengths = torch.sqrt((v**2).sum(dim=-1))
        mask = F.one_hot(labels, 10).float()
        recon = self.decoder.net((v * mask[:, :, None]).view(b, -1)).view(b, 1, 28, 28)
        return lengths, recon


def labml_loss(lengths, recon, images, labels):
    t = F.one_hot(labels, 10).float()
    margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(dim=1).mean()
    return margin + 0.0005 * ((recon - images) ** 2).view(images.shape[0], -1).sum(dim=1).mean()


# --- setup -----------------------------------------------------------------------------------------
def build(batch: int, device: torch.device, channels_last: bool):
    torch.manual_seed(0)
    model = CapsNet().to(device).train()
    labml = LabmlCapsNet().to(device).train()
    labml.load_state_dict({k: v for k, v in model.state_dict().items() if k in labml.state_dict()}, strict=True)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    images = torch.rand(batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    return (
        {
            "capsnet": (model, make_adam(list(model.parameters()), lr=1e-3, device=device)),  # as capsnet train does
            "labml": (labml, torch.optim.Adam(labml.parameters(), lr=1e-3)),
        },
        images,
        labels,
    )


def train_step(variant, model, opt, images, labels, precision, channels_last) -> float:
    opt.zero_grad(set_to_none=True)
    if variant == "labml":
        loss = labml_loss(*model(images, labels), images, labels)
    else:
        x = images.contiguous(memory_format=torch.channels_last) if channels_last else images
        amp = (
            torch.autocast(device_type=images.device.type, dtype=torch.bfloat16)
            if precision == "bf16"
            else contextlib.nullcontext()
        )
        with amp:
            out = model(x, labels)
            loss, _ = model.loss(out, images, labels)
    loss.backward()
    opt.step()
    return loss.item()


def peak_memory_mib(variant, batch, device, precision, channels_last) -> float:
    if device.type == "cuda":
        models, images, labels = build(batch, device, channels_last)
        model, opt = models[variant]
        train_step(variant, model, opt, images, labels, precision, channels_last)  # Adam state exists now
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(variant, model, opt, images, labels, precision, channels_last)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    cmd = [sys.executable, os.path.abspath(__file__), "--_probe", variant, str(batch), "--precision", precision]
    if channels_last:
        cmd.append("--channels-last")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def probe(variant, batch, precision, channels_last) -> None:
    torch.set_num_threads(1)
    models, images, labels = build(batch, torch.device("cpu"), channels_last)
    model, opt = models[variant]
    train_step(variant, model, opt, images, labels, precision, channels_last)  # warm-up, Adam state
    before = reset_peak_rss()
    train_step(variant, model, opt, images, labels, precision, channels_last)
    print(max(0, _status_kib("VmHWM") - before) / 1024)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-sizes", default="64,128")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--_probe", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._probe:
        probe(args._probe[0], int(args._probe[1]), args.precision, args.channels_last)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device={device} threads={torch.get_num_threads()} precision={args.precision} "
        f"channels_last={args.channels_last}; train step (fwd, loss, bwd, Adam), medians of {args.repeats}"
    )
    print(
        f"{'batch':>5} {'labml img/s':>11} {'CapsNet img/s':>14} {'speed-up':>9} {'labml MiB':>9}"
        f" {'CapsNet MiB':>12} {'loss labml':>10} {'loss ours':>10}"
    )
    ok = True
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        models, images, labels = build(batch, device, args.channels_last)
        first = {
            k: train_step(k, m, o, images, labels, args.precision, args.channels_last) for k, (m, o) in models.items()
        }
        tol = 1e-4 if args.precision == "fp32" else 2e-2
        ok &= abs(first["labml"] - first["capsnet"]) <= tol * max(1.0, abs(first["labml"]))
        times: dict[str, list[float]] = {k: [] for k in models}
        for _ in range(args.repeats):
            for k, (m, o) in models.items():
                sync(device)
                t0 = time.perf_counter()
                train_step(k, m, o, images, labels, args.precision, args.channels_last)
                sync(device)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        if args.no_memory:
            mem = {k: float("nan") for k in models}
        else:
            mem = {k: peak_memory_mib(k, batch, device, args.precision, args.channels_last) for k in models}
        print(
            f"{batch:>5} {batch / med['labml']:>11.0f} {batch / med['capsnet']:>14.0f} "
            f"{med['labml'] / med['capsnet']:>8.2f}x {mem['labml']:>9.1f} {mem['capsnet']:>12.1f} "
            f"{first['labml']:>10.6f} {first['capsnet']:>10.6f}",
            flush=True,
        )
    if not ok:
        print("FAILED: the first-step losses differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
