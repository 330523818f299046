"""Model time of `capsnet explore`'s interactions on the CPU: a pose slider move (the decoder on the tweaked
capsule), a routing iteration change (the class layer rerun) and a new image (the whole analysis).

    python benchmarks/bench_explore.py [--model capsnet|efficient-capsnet] [--threads 2] [--repeats 50]

`capsnet` is the paper's MNIST CapsNet (8.2 M parameters, random weights: the time does not depend on them);
`efficient-capsnet` the shipped efficient-capsnet:mnist-sample. Prints the median and the 90th percentile, in ms,
of each callback as the page calls it (image conversion to a PNG for display included for the slider).
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

from capsnet import CapsNet, load_pretrained
from capsnet.cli.checkpoints import pretrained_folder
from capsnet.viz import explore_model as em
from capsnet.viz.explore import Explorer


def timed(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["capsnet", "efficient-capsnet"], default="capsnet")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "capsnet":
        model = CapsNet()
    else:
        model = load_pretrained(pretrained_folder("efficient-capsnet:mnist-sample"))
    ex = Explorer(model)
    from PIL import Image

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "digit.png")
        Image.fromarray((torch.rand(64, 64) * 255).to(torch.uint8).numpy()).save(path)
        a = ex.classify(path)["state"]
        j, d = a.prediction, ex.features.pose_dim
        offsets = [0.1] * d
        rows = [("slider move (reconstruction)", lambda: ex.reconstruction(a, j, offsets))]
        if ex.features.routing:
            rows.append(("routing iteration 1 (class layer rerun)", lambda: ex.routing(a, j, 1)))
        rows.append(("new image (conversion + forward + panels)", lambda: ex.classify(path)))
        print(f"{type(model).__name__}, {args.threads} threads, torch {torch.__version__}, {args.repeats} repeats")
        for name, fn in rows:
            median, p90 = timed(fn, args.repeats)
            print(f"  {name:45s} median {median:7.2f} ms   p90 {p90:7.2f} ms")
    assert em.POSE_RANGE == 0.25
    ex.close()


if __name__ == "__main__":
    main()
