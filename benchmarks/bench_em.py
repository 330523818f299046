"""ConvCaps + EM routing speed and memory: capsnet's layer against a straightforward PyTorch transcription.

The transcription is how the PyTorch ports write it: unfold the children of each parent, votes V [B, P, I, J, 16]
by a broadcast matmul, then Procedure 1 line by line (μ, σ² and the Gaussian log-density from V − μ, recomputed at
each step). It computes the same function (same λ schedule, σ² floor, data normalisation and normalisation of R
over all parents a child reaches) and the script checks that the outputs and gradients agree.

Run:  python benchmarks/bench_em.py                      # ConvCaps1 of the smallNORB model, batch 32, CPU
      python benchmarks/bench_em.py --layer caps2 --batch 8 --device cuda
      python benchmarks/bench_em.py --stability 200          # 200 training steps at r = 1, 2, 3: no NaN

Forward + backward of one layer on random poses and activations: the minimum of --repeat runs after a warm-up,
the two paths alternating. Peak memory: CUDA's max_memory_allocated, or on CPU the growth of the peak RSS, each
path in a fresh subprocess so that one does not hide the other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from capsnet.routing.em import _TINY, DATA_SCALE, MIN_VAR, child_normalizer, inverse_temperature
from capsnet.routing.matrix_capsules import ConvCaps

# (input grid, in types, out types, stride) of the smallNORB model's ConvCaps layers on 32×32 crops (A=B=C=D=32)
LAYERS = {"caps1": (14, 32, 32, 2), "caps2": (6, 32, 32, 1)}


def transcription(layer: ConvCaps, poses: torch.Tensor, acts: torch.Tensor):
    """Procedure 1 as written, on unfolded children  [B, P, I, J, ...]. Returns (poses, activations) of the parents."""
    b, hh, ww, t, _ = poses.shape
    _, _, pos, child = layer.fields(poses)
    p, i, j = child.shape[0], child.shape[1], layer.out_types
    m = poses.reshape(b, hh * ww, t, 16)[:, pos].reshape(b, p, i, 1, 4, 4)  # unfold  [B, P, I, 1, 4, 4]
    a = acts.reshape(b, hh * ww, t)[:, pos].reshape(b, p, i)  # a_i  [B, P, I]
    w = layer.weight.transpose(0, 1)  # W_ij  [I, J, 4, 4]
    v = (m @ w).reshape(b, p, i, j, 16)  # V_ij = M_i W_ij  [B, P, I, J, 16]
    reach = torch.bincount(child.reshape(-1), minlength=hh * ww * t).to(v.dtype)
    r = (1.0 / (j * reach[child])).view(1, p, i, 1).expand(b, p, i, j)  # R_ij uniform over the parents i reaches
    scale = DATA_SCALE * j / i
    for it in range(layer.iterations):
        lam = inverse_temperature(it, layer.final_lambda)
        rp = r * a.unsqueeze(-1)  # R_ij a_i
        mass = rp.sum(dim=2) + _TINY  # Σ_i R_ij  [B, P, J]
        mu = (rp.unsqueeze(-1) * v).sum(dim=2) / mass.unsqueeze(-1)  # μ_jh  [B, P, J, 16]
        var = (rp.unsqueeze(-1) * (v - mu.unsqueeze(2)) ** 2).sum(dim=2) / mass.unsqueeze(-1) + MIN_VAR  # σ²_jh
        cost = (layer.beta_u.view(1, 1, j, 1) + 0.5 * torch.log(var)) * (mass * scale).unsqueeze(-1)
        logits = lam * (layer.beta_a - cost.sum(dim=-1))
        a_out = torch.sigmoid(logits)  # a_j  [B, P, J]
        if it == layer.iterations - 1:
            break
        log_p = -((v - mu.unsqueeze(2)) ** 2 / (2 * var.unsqueeze(2))).sum(dim=-1) \
            - 0.5 * torch.log(2 * math.pi * var).sum(dim=-1).unsqueeze(2)  # log p_ij  [B, P, I, J]  # fmt: skip
        z = torch.nn.functional.logsigmoid(logits).unsqueeze(2) + log_p  # log a_j p_ij
        zt = z.transpose(2, 3)  # the normaliser over every parent a child reaches (all positions)
        r = torch.exp(zt - child_normalizer(zt, child, hh * ww * t)).transpose(2, 3)
    return mu, a_out


def fast(layer: ConvCaps, poses: torch.Tensor, acts: torch.Tensor):
    res, _ = layer.route(poses, acts)
    return res.poses, res.activations


def inputs(name: str, batch: int, device: torch.device, seed: int = 0):
    grid, t_in, t_out, stride = LAYERS[name]
    torch.manual_seed(seed)
    layer = ConvCaps(t_in, t_out, kernel_size=3, stride=stride).to(device)
    with torch.no_grad():
        layer.beta_u.normal_(0, 1)
        layer.beta_a.normal_(0, 1)
    poses = torch.randn(batch, grid, grid, t_in, 16, device=device, requires_grad=True)
    acts = torch.rand(batch, grid, grid, t_in, device=device, requires_grad=True)
    return layer, poses, acts


def step(fn, layer, poses, acts) -> None:
    mu, a = fn(layer, poses, acts)
    (mu.square().mean() + a.sum()).backward()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_both(name: str, batch: int, device: torch.device, repeat: int) -> dict[str, float]:
    """Seconds per forward+backward of each path: the minimum over `repeat` runs, the paths alternating so that
    load from other processes on a shared machine hits both alike (after one warm-up run each)."""
    layer, poses, acts = inputs(name, batch, device)
    paths = {"transcription": transcription, "fast": fast}
    best = dict.fromkeys(paths, math.inf)
    for k in range(repeat + 1):
        for path, fn in paths.items():
            poses.grad = acts.grad = None
            layer.zero_grad(set_to_none=True)
            sync(device)
            t0 = time.perf_counter()
            step(fn, layer, poses, acts)
            sync(device)
            if k > 0:
                best[path] = min(best[path], time.perf_counter() - t0)
    return best


def peak_memory(path: str, name: str, batch: int, device: torch.device) -> float:
    """Peak memory of one forward+backward in MiB above what the inputs hold, in this process: CUDA's
    max_memory_allocated, or on CPU the growth of the peak RSS (VmHWM; run in a fresh process; glibc returns the large
    blocks to the system at once because MALLOC_MMAP_THRESHOLD_ is set low by the caller)."""
    fn = fast if path == "fast" else transcription
    layer, poses, acts = inputs(name, batch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(fn, layer, poses, acts)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    rss0 = _peak_rss_kib()
    step(fn, layer, poses, acts)
    return (_peak_rss_kib() - rss0) / 2**10


def _peak_rss_kib() -> int:
    """VmHWM, the peak resident set of this process (per address space, so not inherited across exec as getrusage's
    ru_maxrss is)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def check_equal(name: str, batch: int, device: torch.device) -> float:
    """Largest relative difference of outputs and input gradients between the two paths (float64)."""
    diffs = []
    outs = {}
    for path, fn in (("fast", fast), ("transcription", transcription)):
        layer, poses, acts = inputs(name, batch, device)
        layer.double()
        poses, acts = poses.detach().double().requires_grad_(), acts.detach().double().requires_grad_()
        mu, a = fn(layer, poses, acts)
        (mu.square().mean() + a.sum()).backward()
        outs[path] = [mu, a, poses.grad, acts.grad, layer.weight.grad, layer.beta_u.grad, layer.beta_a.grad]
    for x, y in zip(outs["fast"], outs["transcription"]):
        diffs.append(float((x - y).abs().max().detach() / y.abs().max().detach().clamp_min(1e-12)))
    return max(diffs)


def stability(steps: int, iterations: int, *, batch: int = 16, seed: int = 0, **options) -> dict:
    """Train a small EMCapsNet (A=16, B=C=D=4) on the bundled MNIST sample for `steps` Adam steps at the model's
    default learning rate: NaN/inf count, mean loss of the first and last 20 steps, accuracy on 500 test digits."""
    from capsnet.data import load_dataset
    from capsnet.models import EMCapsNet

    torch.manual_seed(seed)
    data = load_dataset("mnist-sample")
    model = EMCapsNet(image_size=28, n_classes=10, conv_channels=16, primary_types=4, caps1_types=4, caps2_types=4,
                      routing_iterations=iterations, margin_anneal_steps=steps, **options)  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=EMCapsNet.default_lr)
    g = torch.Generator().manual_seed(seed)
    losses, bad = [], 0
    for _ in range(steps):
        idx = torch.randint(0, len(data.train), (batch,), generator=g)
        x, y = data.train.images[idx].float() / 255.0, data.train.labels[idx]
        loss, _ = model.loss(model(x), x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        finite = math.isfinite(loss.item()) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
        bad += not finite
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        x, y = data.test.images[:500].float() / 255.0, data.test.labels[:500]
        acc = float((model(x).predictions == y).float().mean())
    k = min(20, steps)
    return {"r": iterations, "steps": steps, "non_finite_steps": bad, "first_loss": sum(losses[:k]) / k,
            "last_loss": sum(losses[-k:]) / k, "test_acc_500": acc}  # fmt: skip


def screen(steps: int, seed: int, **options) -> dict:
    """Train the small EMCapsNet of `stability` (r = 3) for `steps` Adam steps on the bundled sample's training
    digits but its last 1,000, and score it on those 1,000 (held out; the test digits are not read)."""
    from capsnet.data import load_dataset
    from capsnet.models import EMCapsNet

    torch.manual_seed(seed)
    data = load_dataset("mnist-sample")
    n_train = len(data.train) - 1000
    model = EMCapsNet(image_size=28, n_classes=10, conv_channels=16, primary_types=4, caps1_types=4, caps2_types=4,
                      margin_anneal_steps=steps, **options)  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=EMCapsNet.default_lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, n_train, (16,), generator=g)
        x, y = data.train.images[idx].float() / 255.0, data.train.labels[idx]
        loss, _ = model.loss(model(x), x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        x, y = data.train.images[n_train:].float() / 255.0, data.train.labels[n_train:]
        acc = float((model(x).predictions == y).float().mean())
    return {**options, "seed": seed, "steps": steps, "val_acc_1000": acc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layer", choices=sorted(LAYERS), default="caps1")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--memory-of", choices=["fast", "transcription"], help=argparse.SUPPRESS)  # one path's peak
    p.add_argument("--stability", type=int, metavar="STEPS", help="instead: train STEPS steps at r = 1, 2, 3")
    p.add_argument(
        "--screen-coordinates",
        type=int,
        metavar="STEPS",
        help="instead: train STEPS steps with each coordinate_style, seeds 0 and 1, scored on held-out digits",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stability:
        for r in (1, 2, 3):
            print(json.dumps(stability(args.stability, r)), flush=True)
        return 0
    if args.screen_coordinates:
        for seed in (0, 1):
            for style in ("grid", "receptive-field"):
                print(json.dumps(screen(args.screen_coordinates, seed, coordinate_style=style)), flush=True)
        return 0
    if args.memory_of:
        print(json.dumps(peak_memory(args.memory_of, args.layer, args.batch, device)))
        return 0
    diff = check_equal(args.layer, min(args.batch, 2), device)
    print(f"{args.layer}, batch {args.batch}, {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"max relative difference of outputs and gradients (float64, batch 2): {diff:.1e}")  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    mem = {}
    for path in ("transcription", "fast"):
        cmd = [sys.executable, __file__, "--layer", args.layer, "--batch", str(args.batch), "--device", args.device,
               "--memory-of", path, *(["--threads", str(args.threads)] if args.threads else [])]  # fmt: skip
        mem[path] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
    secs = time_both(args.layer, args.batch, device, args.repeat)
    for path in ("transcription", "fast"):
        print(f"  {path:13s} {secs[path] * 1000:9.1f} ms   peak {mem[path]:8.1f} MiB")
    print(f"  speed-up {secs['transcription'] / secs['fast']:.2f}x, "
          f"peak memory {mem['fast'] / max(mem['transcription'], 1e-9):.2f}x the transcription's")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
