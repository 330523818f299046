"""Forward+backward of each routing layer in capsnet.routing vs a straightforward PyTorch transcription of its
paper's procedure, at the same sizes; results must be equal.

    python benchmarks/bench_routing_algos.py [--batch-size 64] [--repeats 5] [--threads N] [--only NAME,...]
        [--device cpu|cuda]

The transcriptions follow each paper's procedure line by line with einsum, as a reader of the paper would write
it: dynamic routing (Procedure 1, labml's formulation, as benchmarks/bench_routing.py), self-attention routing
with the attention matrices A_j = Û_j Û_jᵀ/√d formed (Efficient-CapsNet), Procedure 1 of Tsai et al. with the
votes formed once, self-routing with the votes, routing logits and weighted means as written. Layer sizes: the
class capsules of the paper's CapsNet (1152 × 8D → 10 × 16D) and of Efficient-CapsNet (16 × 8D → 10 × 16D).

Both sides run interleaved (the machine may be shared); the medians of `--repeats` timed steps after a warm-up are
compared. Exits with status 1 if an output or a gradient differs by more than 1e-4 (relative to its scale).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from capsnet.routing import InvertedAttentionFC, Router, SelfAttentionRouter, SelfRoutingFC

CAPSNET, EFFICIENT = (1152, 10, 8, 16), (16, 10, 8, 16)


# ------------------------------------------------------------------------------- the paper transcriptions
def squash(s):
    sq = (s**2).sum(dim=-1, keepdim=True)
    return (sq / (1 + sq)) * (s / torch.sqrt(sq + 1e-8))


def dynamic_paper(layer, u, a=None):
    u_hat = torch.einsum("ijnm,bin->bijm", layer.weight, u)  # û_j|i = W_ij u_i
    b = u.new_zeros(u.shape[0], layer.in_caps, layer.out_caps)
    for r in range(layer.iterations):
        c = torch.softmax(b, dim=2)
        v = squash(torch.einsum("bij,bijm->bjm", c, u_hat))
        if r < layer.iterations - 1:
            b = b + torch.einsum("bjm,bijm->bij", v, u_hat)
    return v


def self_attention_paper(layer, u, a=None):
    u_hat = torch.einsum("ijnm,bin->bjim", layer.weight, u)  # Û_j: the votes for parent j  [B, J, I, d]
    a = torch.einsum("bjim,bjkm->bjik", u_hat, u_hat) / math.sqrt(u_hat.shape[-1])  # A_j = Û_j Û_jᵀ / √d
    c = torch.softmax(a.sum(dim=-1), dim=1)  # softmax over the parents of Σ_k A_j[i, k]  [B, J, I]
    s = torch.einsum("bjim,bji->bjm", u_hat, c + layer.prior.t())  # s_j = Σ_i û_ij (c_ij + b_ij)
    norm = torch.sqrt((s**2).sum(dim=-1, keepdim=True) + 1e-8)
    return (1 - torch.exp(-norm)) * s / norm


def inverted_attention_paper(layer, u, a=None):
    v = torch.einsum("ijnm,bin->bijm", layer.weight, u)  # Eq. 1: v_ij = W_ij p_i
    p = None
    for _ in range(layer.iterations):
        if p is None:
            r = torch.full(v.shape[:3], 1.0 / v.shape[2], dtype=v.dtype, device=v.device)
        else:
            r = torch.softmax(torch.einsum("bjm,bijm->bij", p, v), dim=2)  # Eqs. 2, 3
        p = F.layer_norm(torch.einsum("bij,bijm->bjm", r, v), (v.shape[-1],), layer.norm.weight, layer.norm.bias)
    return p


def self_routing_paper(layer, u, a):
    c = torch.softmax(torch.einsum("bin,inj->bij", u, layer.route_weight) + layer.route_bias, dim=2)
    u_hat = torch.einsum("ijnm,bin->bijm", layer.pose_weight, u)  # û_j|i = W_ij u_i
    ca = c * a[:, :, None]
    return torch.einsum("bij,bijm->bjm", ca, u_hat) / (ca.sum(dim=1)[:, :, None] + 1e-8)


# ------------------------------------------------------------------------------------------------ harness
def cases():
    """(name, sizes, layer, module step inputs -> output, transcription)."""
    return [
        ("dynamic (Router, r=3)", CAPSNET, lambda s: Router(*s, 3), lambda m, u, a: m(u), dynamic_paper),
        ("self-attention", CAPSNET, lambda s: SelfAttentionRouter(*s), lambda m, u, a: m(u), self_attention_paper),
        ("self-attention", EFFICIENT, lambda s: SelfAttentionRouter(*s), lambda m, u, a: m(u), self_attention_paper),
        ("inverted-attention (r=3)", CAPSNET, lambda s: InvertedAttentionFC(*s, 3), lambda m, u, a: m(u),
         inverted_attention_paper),
        ("self-routing", CAPSNET, lambda s: SelfRoutingFC(*s), lambda m, u, a: m(u, a),
         lambda m, u, a: self_routing_paper(m, u, a)),
    ]  # fmt: skip


def step(fn, layer, u, a, probe):
    for p in (u, *layer.parameters()):
        p.grad = None
    sync = torch.cuda.synchronize if u.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn(layer, u, a)
    (out * probe).sum().backward()
    sync()
    return time.perf_counter() - t0, out.detach(), [u.grad.clone(), *(p.grad.clone() for p in layer.parameters())]


def max_rel_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the case names to run")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K")
    args = ap.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"error: --device: expected cpu, cuda or cuda:K, got {args.device!r}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA GPU here", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"batch {args.batch_size}, {where}, torch {torch.__version__}, "
          f"median of {args.repeats}")  # fmt: skip
    print("| layer | sizes (in × d → out × d) | module img/s | paper transcription img/s | speed-up | max rel. diff |")
    print("|---|---|---:|---:|---:|---:|")
    ok = True
    for name, sizes, make, module_fn, paper_fn in cases():
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        torch.manual_seed(0)
        layer = make(sizes).to(device)
        with torch.no_grad():  # non-trivial values for the zero-initialised parameters
            for p in layer.parameters():
                if p.abs().max() == 0:
                    p.normal_(std=0.1)
        u = (torch.randn(args.batch_size, sizes[0], sizes[2]) * 0.3).to(device).requires_grad_()
        a = torch.rand(args.batch_size, sizes[0]).to(device)
        probe = torch.randn(args.batch_size, sizes[1], sizes[3]).to(device)
        times: dict[str, list[float]] = {"module": [], "paper": []}
        results = {}
        for rep in range(args.repeats + 1):  # the first round warms up
            for side, fn in (("module", module_fn), ("paper", paper_fn)):
                dt, out, grads = step(fn, layer, u, a, probe)
                if rep:
                    times[side].append(dt)
                results[side] = (out, grads)
        (out_m, grads_m), (out_p, grads_p) = results["module"], results["paper"]
        diff = max(max_rel_diff(x, y) for x, y in zip([out_m, *grads_m], [out_p, *grads_p], strict=True))
        ok &= diff < 1e-4
        m, p = (statistics.median(times[k]) for k in ("module", "paper"))
        size = f"{sizes[0]} × {sizes[2]} → {sizes[1]} × {sizes[3]}"
        print(f"| {name} | {size} | {args.batch_size / m:,.0f} | {args.batch_size / p:,.0f} | {p / m:.2f}× | "
              f"{diff:.1e} |", flush=True)  # fmt: skip
    if not ok:
        print("results differ", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
