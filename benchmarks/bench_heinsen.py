"""Heinsen's routings: capsnet's layers against the authors' modules (glassroom/heinsen_routing), side by side.

Run:  CAPSNET_HEINSEN_ROUTING=PATH python benchmarks/bench_heinsen.py          # every case, CPU
      CAPSNET_HEINSEN_ROUTING=PATH python benchmarks/bench_heinsen.py --case sequence-10k --repeat 3

PATH is a checkout of their repository (heinsen_routing/heinsen_routing.py); without it only capsnet's layers run.
Each case is forward + backward of one routing at the authors' shapes, on the same inputs with the same parameters
(theirs copied into ours), in this process with the same threads: the minimum of --repeat runs after a warm-up, the
two paths alternating so that load from other processes hits both alike. The ratio is theirs / ours (> 1: capsnet
is faster). Peak memory (--memory): the growth of the peak RSS (VmHWM) over one forward + backward, each path in a
fresh subprocess (MALLOC_MMAP_THRESHOLD_ set low, so that freed blocks go back to the system at once).

Cases:
    capsnet       --routing heinsen in the paper's CapsNet: 1152 vectors of 8 -> 10 of 16, batch 32, r = 3
    parts         heinsen-capsnet's first routing: 64·9² = 5,184 4×4 matrices (one W) -> 64, batch 4, r = 3
    objects       its second: 64 -> 5, batch 20
    vectors       EfficientVectorRouting, 2,000 vectors of 256 -> 100 of 256, batch 4, r = 2
    sequence-10k  a sequence of 10,000 vectors of 64 (any length, n_inp = -1) -> 32 of 64, a mask hiding a
                  quarter of the (input, output) pairs, batch 1, r = 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from capsnet.routing.heinsen import HeinsenRouting
from capsnet.routing.heinsen_vector import HeinsenVectorRouting

CASES = ("capsnet", "parts", "objects", "vectors", "sequence-10k")


def authors() -> ModuleType | None:
    """Their heinsen_routing module, from CAPSNET_HEINSEN_ROUTING, or None."""
    folder = os.environ.get("CAPSNET_HEINSEN_ROUTING")
    path = Path(folder or "") / "heinsen_routing" / "heinsen_routing.py"
    if not folder or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("authors_heinsen_routing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(case: str, theirs: ModuleType | None, seed: int = 0, *, small: bool = False) -> dict[str, Any]:
    """The case's layers (ours; theirs with the same parameters, when given), inputs, and the call of each; `small`:
    2 samples of at most 100 capsules (a warm-up that loads the libraries' lazy parts)."""
    torch.manual_seed(seed)
    if case in ("capsnet", "parts", "objects"):
        n_in, n_out, rows, d_in, d_out, batch = {"capsnet": (1152, 10, 1, 8, 16, 32), "parts": (-1, 64, 4, 4, 4, 4),
                                                 "objects": (64, 5, 4, 4, 4, 20)}[case]  # fmt: skip
        ours = HeinsenRouting(n_in, n_out, rows * d_in, rows * d_out, rows=rows)
        count = 5184 if n_in == -1 else n_in
        batch, count = (2, min(count, 100)) if small and n_in == -1 else (2 if small else batch, count)
        a, mu = torch.randn(batch, count), torch.randn(batch, count, rows, d_in)
        inputs = [a.requires_grad_(), mu.requires_grad_()]
        calls = {"capsnet": lambda: ours.route(*inputs)[:3]}
        if theirs is not None:
            their = theirs.GenerativeMatrixRouting(n_inp=n_in, n_out=n_out, d_cov=rows, d_inp=d_in, d_out=d_out)
            with torch.no_grad():
                for p in their.parameters():
                    p.normal_(0, 0.1)
                ours.weight.copy_(their.W), ours.bias.copy_(their.B)
                ours.beta_use.copy_(their.beta_use), ours.beta_ign.copy_(their.beta_ign)
            calls["authors"] = lambda: their(*inputs)
        return {"calls": calls, "inputs": inputs}
    n_in, n_out, d_in, d_out, batch, length = {"vectors": (2000, 100, 256, 256, 4, 2000),
                                               "sequence-10k": (-1, 32, 64, 64, 1, 10_000)}[case]  # fmt: skip
    if small:
        n_in, batch, length = (-1, 1, 100) if n_in == -1 else (n_in, 1, length)
    ours_v = HeinsenVectorRouting(n_in, n_out, d_in, d_out)
    x = torch.randn(batch, length, d_in, requires_grad=True)
    mask = None
    if case == "sequence-10k":  # (every input seen by some output: theirs gives NaN for one no output sees)
        mask = torch.rand(length, n_out) < 0.25
        mask[:, 0] = False
    calls = {"capsnet": lambda: [ours_v(x, mask=mask)]}
    if theirs is not None:
        their_v = theirs.EfficientVectorRouting(n_inp=n_in, n_out=n_out, d_inp=d_in, d_out=d_out)
        names = {"W_A": "w_a", "B_A": "b_a", "W_F1": "w_f1", "W_F2": "w_f2", "B_F2": "b_f2", "W_G1": "w_g1",
                 "W_G2": "w_g2", "B_G2": "b_g2", "W_S": "w_s", "B_S": "b_s"}  # fmt: skip
        state = {names.get(k, k.replace("compute_", "").replace("beta_use.", "beta_use_net.")
                           .replace("beta_ign.", "beta_ign_net.")): v for k, v in their_v.state_dict().items()
                 if k != "CONST_ones_over_n_out"}  # fmt: skip
        ours_v.load_state_dict(state)
        calls["authors"] = lambda: [their_v(x, mask=mask)]
    return {"calls": calls, "inputs": [x]}


def step(call) -> None:
    outs = call()
    sum(o.float().square().mean() for o in outs).backward()


def time_case(case: str, theirs: ModuleType | None, repeat: int) -> dict[str, float]:
    """Seconds per forward + backward of each path: the minimum over `repeat` alternating runs after a warm-up."""
    built = build(case, theirs)
    best = dict.fromkeys(built["calls"], math.inf)
    for k in range(repeat + 1):
        for path, call in built["calls"].items():
            for t in built["inputs"]:
                t.grad = None
            t0 = time.perf_counter()
            step(call)
            if k > 0:
                best[path] = min(best[path], time.perf_counter() - t0)
    return best


def peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def peak_memory(case: str, path: str) -> float:
    """MiB the peak RSS grows by over one forward + backward of `path` (run in a fresh process: --child), after a
    small warm-up of the same path."""
    theirs = authors() if path == "authors" else None
    step(build(case, theirs, small=True)["calls"][path])
    built = build(case, theirs)
    rss0 = peak_rss_kib()
    step(built["calls"][path])
    return (peak_rss_kib() - rss0) / 2**10


def memory_in_subprocess(case: str, path: str) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, __file__, "--child", case, path]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_mib"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, action="append", help="(repeatable; default: every case)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory runs")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"peak_mib": peak_memory(*args.child)}))
        return 0
    theirs = authors()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; authors' code: {'found' if theirs else 'absent (set CAPSNET_HEINSEN_ROUTING)'}")  # fmt: skip
    print("| case | capsnet ms | authors' ms | ratio | capsnet peak MiB | authors' peak MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in args.case or CASES:
        t = time_case(case, theirs, args.repeat)
        mem = {p: memory_in_subprocess(case, p) for p in t} if args.memory else {}
        ours, their = t["capsnet"] * 1e3, t.get("authors", math.nan) * 1e3
        print(f"| {case} | {ours:.1f} | {their:.1f} | {their / ours:.2f}x | {mem.get('capsnet', math.nan):.0f} | "
              f"{mem.get('authors', math.nan):.0f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
