"""VB routing speed on CPU: capsnet's layers against the authors' released ones (fabio-deep/Variational-Capsule-Routing,
layers.py + vb_routing.py), side by side in one process, same threads, same weights and inputs.

Their code is not part of capsnet: the script reads it from CAPSNET_VB_ROUTING_CODE (a checkout of their repository
or its git directory) or CAPSNET_MIRRORS (a folder of fetched repositories), and stops with one line without it.
Their layers call `.cuda()` in forward; here that is the identity.

Run:  python benchmarks/bench_vb.py                          # the smallNORB model's layers, batch 32, 2 threads
      python benchmarks/bench_vb.py --batch 8 --threads 1 --layers caps1
      python benchmarks/bench_vb.py --memory --layers net        # peak memory instead, each side in a fresh process

Forward + backward of one layer (or the whole network, "net") on random inputs: the minimum of --repeat runs after a
warm-up, the two implementations alternating. `--memory`: the growth of the peak resident set (ru_maxrss) over one
forward + backward, each implementation in a fresh process of its own.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from capsnet.models.vb_capsnet import VBCapsNet
from capsnet.routing.vb_conv import VBClassCaps, VBConvCaps

REPO = "fabio-deep+Variational-Capsule-Routing"
# (input grid, in types, out types, kernel, stride) of the authors' smallNORB model on 32×32 crops (64 8 16 16 5)
LAYERS = {"caps1": (14, 8, 16, 3, 2), "caps2": (6, 16, 16, 3, 1), "class": (4, 16, 5, 4, 1)}


def load_theirs() -> SimpleNamespace:
    """Their vb_routing, layers and capsnet modules, executed from their source."""
    roots = [os.environ.get("CAPSNET_VB_ROUTING_CODE", "")]
    if os.environ.get("CAPSNET_MIRRORS"):
        roots.append(str(Path(os.environ["CAPSNET_MIRRORS"]) / REPO / "repo"))
    modules = {}
    for name in ("vb_routing", "layers", "capsnet"):
        text = None
        for root in filter(None, roots):
            path = Path(root) / "src" / f"{name}.py"
            if path.is_file():
                text = path.read_text(encoding="utf-8")
            elif (Path(root) / "HEAD").is_file():
                done = subprocess.run(["git", "--git-dir", root, "show", f"HEAD:src/{name}.py"], capture_output=True,
                                      text=True, check=False)  # fmt: skip
                text = done.stdout if done.returncode == 0 else None
            if text:
                break
        if not text:
            sys.exit("bench_vb: the authors' code is absent (set CAPSNET_VB_ROUTING_CODE or CAPSNET_MIRRORS)")
        module = types.ModuleType(name)
        exec(compile(text, f"their {name}.py", "exec"), module.__dict__)
        sys.modules[name] = modules[name] = module
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    return SimpleNamespace(**modules)


def layer_pair(theirs, name: str):
    """(ours(poses, acts), theirs(a, poses) callables, their inputs, a function of their inputs to ours)."""
    grid, t_in, t_out, k, s = LAYERS[name]
    torch.manual_seed(0)
    routing = theirs.vb_routing.VariationalBayesRouting2d(
        in_caps=t_in, out_caps=t_out, pose_dim=4, kernel_size=k, stride=s, alpha0=1.0, m0=torch.zeros(16),
        kappa0=1.0, Psi0=torch.eye(16), nu0=17, cov="diag", iter=3, class_caps=name == "class",
    )  # fmt: skip
    if name == "class":
        caps = theirs.layers.ConvCapsules2d(in_caps=t_in, out_caps=t_out, pose_dim=4, kernel_size=1, stride=1,
                                            share_W_ij=True, coor_add=True)  # fmt: skip
        ours = VBClassCaps(t_in, t_out, centres=torch.full((grid * grid, 2), 0.1))
        with torch.no_grad():
            ours.weight.copy_(caps.W_ij[0, :, :, 0, :, :, 0, 0, 0, 0].transpose(0, 1))
    else:
        caps = theirs.layers.ConvCapsules2d(in_caps=t_in, out_caps=t_out, pose_dim=4, kernel_size=k, stride=s)
        ours = VBConvCaps(t_in, t_out, kernel_size=k, stride=s)
        with torch.no_grad():
            ours.weight.copy_(caps.W_ij[0, :, :, 0, :, :, 0, 0].permute(1, 4, 5, 0, 2, 3).reshape(t_out, -1, 4, 4))

    def run_ours(a, poses):
        b, t, _, _, h, w = poses.shape
        out = ours(poses.permute(0, 4, 5, 1, 2, 3).reshape(b, h, w, t, 16), a.permute(0, 2, 3, 1))
        return out[0], out[1]

    def run_theirs(a, poses):
        a_out, m_out = routing(*caps(a, poses))
        return m_out, a_out

    return run_ours, run_theirs, grid, t_in


def net_pair(theirs):
    torch.manual_seed(0)
    their_net = theirs.capsnet.CapsuleNet(SimpleNamespace(pose_dim=4, arch=[64, 8, 16, 16, 5], n_channels=2,
                                                          routing_iter=3))  # fmt: skip
    ours = VBCapsNet()
    return (lambda x: ours(x).lengths), their_net


def timed(fn, inputs) -> float:
    start = time.perf_counter()
    out = fn(*inputs)
    sum(o.float().square().sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    return time.perf_counter() - start


def pair_inputs(theirs, name: str, batch: int):
    """(ours, theirs, inputs) for a layer name or "net"."""
    if name == "net":
        ours, their = net_pair(theirs)
        return ours, their, [torch.randn(batch, 2, 32, 32)]
    ours, their, grid, t_in = layer_pair(theirs, name)
    g = torch.Generator().manual_seed(1)
    return ours, their, [torch.rand(batch, t_in, grid, grid, generator=g).requires_grad_(),
                         torch.randn(batch, t_in, 4, 4, grid, grid, generator=g).requires_grad_()]  # fmt: skip


def peak_growth(args, name: str, label: str) -> float:
    """MiB by which one forward + backward of `label`'s side raises the peak resident set, in a fresh process."""
    argv = ["--one", label, "--layers", name, "--batch", str(args.batch), "--threads", str(args.threads)]
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", default="caps1,caps2,class,net")
    parser.add_argument("--memory", action="store_true", help="peak memory instead of time")
    parser.add_argument("--one", choices=["capsnet", "authors"], help=argparse.SUPPRESS)  # (a --memory child)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    theirs = load_theirs()
    if args.one:
        ours, their, inputs = pair_inputs(theirs, args.layers, args.batch)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        timed(ours if args.one == "capsnet" else their, inputs)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
        return
    what = "peak memory growth (MiB)" if args.memory else f"forward + backward, min of {args.repeat} (ms)"
    print(f"CPU, {args.threads} threads, batch {args.batch}, {what}")
    print(f"{'layer':<8}{'capsnet':>10}{'authors':>10}{'ratio':>8}")
    for name in args.layers.split(","):
        if args.memory:
            mine, theirs_mib = peak_growth(args, name, "capsnet"), peak_growth(args, name, "authors")
            print(f"{name:<8}{mine:>10.0f}{theirs_mib:>10.0f}{mine / theirs_mib:>7.2f}x", flush=True)
            continue
        ours, their, inputs = pair_inputs(theirs, name, args.batch)
        best = {"capsnet": float("inf"), "authors": float("inf")}
        for _ in range(args.repeat + 1):  # the first round warms up
            for label, fn in (("capsnet", ours), ("authors", their)):
                best[label] = min(best[label], timed(fn, inputs))
        ratio = best["capsnet"] / best["authors"]
        print(f"{name:<8}{best['capsnet'] * 1e3:>10.0f}{best['authors'] * 1e3:>10.0f}{ratio:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
