"""Forward+backward of capsnet.Router vs labml's einsum formulation of dynamic routing (MNIST shape).

    python benchmarks/bench_routing.py [--device cpu|cuda] [--batch-sizes 32,64,128] [--repeats 7]
                                       [--impl router|torch-fast|both]

`--impl router` (default) times capsnet.Router as dispatched (on CPU the fused C++ kernel of
capsnet.routing.dynamic_cpu, when it builds); `torch-fast` times capsnet.routing.fast_dynamic_routing
(PyTorch ops); `both` times both.

Both variants run interleaved in one process (the machine may be shared) and the medians are compared.
Peak memory: on CUDA torch.cuda.max_memory_allocated; on CPU the growth of the peak resident set size
(VmHWM, reset through /proc/self/clear_refs) over the resident size before one step, in a fresh subprocess
per variant (with one thread).
Checks that outputs and the gradients of u and W agree (max abs diff) and exits with status 1 if they don't.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from capsnet import Router
from capsnet.routing import fast_dynamic_routing

IN_CAPS, OUT_CAPS, IN_D, OUT_D = 1152, 10, 8, 16


# --- labml's formulation (the reference; labml's annotated CapsNet, the article capsnet started from) ----
def labml_squash(s: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    sq = (s**2).sum(dim=-1, keepdim=True)
    return (sq / (1 + sq)) * (s / torch.sqrt(sq + eps))


def labml_routing(u: torch.Tensor, weight: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    u_hat = torch.einsum("ijnm,bin->bijm", weight, u)
    b = u.new_zeros(u.shape[0], weight.shape[0], weight.shape[1])
    v = None
    for i in range(iterations):
        c = torch.softmax(b, dim=2)
        s = torch.einsum("bij,bijm->bjm", c, u_hat)
        v = labml_squash(s)
        if i < iterations - 1:
            a = torch.einsum("bjm,bijm->bij", v, u_hat)
            b = b + a
    return v


# --- helpers ---------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_inputs(batch: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    router = Router(IN_CAPS, OUT_CAPS, IN_D, OUT_D, iterations=3).to(device)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * router.weight_std)
    u = (torch.randn(batch, IN_CAPS, IN_D, generator=g) * 0.3).to(device).requires_grad_()
    grad_out = torch.randn(batch, OUT_CAPS, OUT_D, generator=g).to(device)
    return router, u, grad_out


def step(variant: str, router: Router, u: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """One forward + backward; returns v."""
    u.grad = None
    router.weight.grad = None
    if variant == "router":
        v = router(u)
    elif variant == "torch-fast":
        v = fast_dynamic_routing(u, router.weight, router.iterations)[0]
    else:
        v = labml_routing(u, router.weight)
    v.backward(grad_out)
    return v


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Resets the peak resident set size (VmHWM) to the current one and returns that, in KiB (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # older kernels: the peak then includes start-up, and ru_maxrss is used below
    return _status_kib("VmRSS")


def peak_memory_mib(variant: str, batch: int, device: torch.device) -> float:
    if device.type == "cuda":
        router, u, g = make_inputs(batch, device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(variant, router, u, g)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    # CPU: a fresh process, so that the peak RSS belongs to this one step
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_probe", variant, str(batch)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def probe(variant: str, batch: int) -> None:
    torch.set_num_threads(1)
    step(variant, *make_inputs(1, torch.device("cpu")))  # page in the kernels' code and one-off buffers
    router, u, g = make_inputs(batch, torch.device("cpu"))
    before = reset_peak_rss()
    step(variant, router, u, g)
    try:
        peak = _status_kib("VmHWM")
    except (OSError, RuntimeError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(max(0, peak - before) / 1024)


def max_diffs(batch: int, device: torch.device, variant: str = "router") -> dict[str, float]:
    router, u, g = make_inputs(batch, device)
    out = {}
    for name in (variant, "labml"):
        v = step(name, router, u, g)
        out[name] = (v.detach().clone(), u.grad.clone(), router.weight.grad.clone())
    names = ("v", "grad_u", "grad_W")
    return {n: (a - b).abs().max().item() for n, a, b in zip(names, out[variant], out["labml"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-sizes", default="32,64,128")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--tolerance", type=float, default=1e-5, help="max abs diff allowed (fp32)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument(
        "--impl",
        default="router",
        choices=["router", "torch-fast", "both"],
        help="what to compare with labml's formulation (router: capsnet.Router as dispatched)",
    )
    p.add_argument("--_probe", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._probe:
        probe(args._probe[0], int(args._probe[1]))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"shape: {IN_CAPS}x{IN_D} -> {OUT_CAPS}x{OUT_D}, 3 iterations, forward+backward, medians of {args.repeats}"
    )
    impls = ["router", "torch-fast"] if args.impl == "both" else [args.impl]
    print(
        f"{'impl':>10} {'batch':>5} {'labml img/s':>11} {'impl img/s':>11} {'speed-up':>9} {'labml MiB':>9}"
        f" {'impl MiB':>9} {'max|dv|':>9} {'max|du|':>9} {'max|dW|':>9}"
    )
    ok = True
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        diffs = {k: max_diffs(batch, device, k) for k in impls}
        ok &= all(d <= args.tolerance for dk in diffs.values() for d in dk.values())
        router, u, g = make_inputs(batch, device)
        times: dict[str, list[float]] = {k: [] for k in ["labml", *impls]}
        for variant in times:  # warm-up
            step(variant, router, u, g)
        for _ in range(args.repeats):
            for variant, ts in times.items():
                sync(device)
                t0 = time.perf_counter()
                step(variant, router, u, g)
                sync(device)
                ts.append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        if args.no_memory:
            mem = {k: float("nan") for k in times}
        else:
            mem = {k: peak_memory_mib(k, batch, device) for k in times}
        for k in impls:
            d = diffs[k]
            print(
                f"{k:>10} {batch:>5} {batch / med['labml']:>11.0f} {batch / med[k]:>11.0f} "
                f"{med['labml'] / med[k]:>8.2f}x {mem['labml']:>9.1f} {mem[k]:>9.1f} "
                f"{d['v']:>9.1e} {d['grad_u']:>9.1e} {d['grad_W']:>9.1e}",
                flush=True,
            )
    if not ok:
        print(f"FAILED: outputs or gradients differ by more than {args.tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
