"""Cluster routing: capsnet's layers vs the authors' released code, side by side in one process, forward+backward.

    python benchmarks/bench_cluster.py --authors DIR [--batch-size 16] [--fc-batch-size 64] [--repeats 3]
        [--threads N] [--only NAME,...]

DIR holds the authors' repository (github.com/ZHAOZHIHAO/ClusterRouting): a checkout, or the folder `fetch` makes
(a bare git repository in DIR/repo, read with `git archive`); default: $CAPSNET_AUTHORS_CODE/ZHAOZHIHAO+ClusterRouting.
Nothing of it is copied into capsnet.

Rows (their CIFAR-10 model, main.py's defaults C 4, K 8, D 24, 32×32 RGB):

    caps1 .. caps5   each `CapsLayerWithClusterRouting` against capsnet.routing.cluster_conv.ClusterRoutingConv
    model            their `CapsuleNetwork` against capsnet's ClusterCapsNet (weights copied)
    fc               `--routing cluster` on CapsNet's class capsules (1152 × 8 → 10 × 16, K 8): ClusterRoutingFC's
                     moments path against the same layer forming the K votes (`fast=False`; the authors have no
                     fully connected layer)

Both sides run interleaved (the machine may be shared); the medians of `--repeats` timed steps after a warm-up are
compared. Exits with status 1 if an output differs by more than 1e-4 (relative to its scale).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from capsnet.models.cluster_capsnet import ClusterCapsNet
from capsnet.routing.cluster import ClusterRoutingFC
from capsnet.routing.cluster_conv import ClusterRoutingConv

FILE = "src/capsule_network.py"
ARGS = Namespace(C=4, K=8, D=24, input_img_dim=3, input_img_size=32, if_bias=True, class_num=10)


def load_authors(folder: Path, scratch: Path):
    """Their capsule_network module, from a checkout or a bare repository in folder/repo."""
    path = folder / FILE
    if not path.is_file() and (folder / "repo").is_dir():
        tar = subprocess.run(["git", "--git-dir", str(folder / "repo"), "archive", "HEAD", FILE],
                             capture_output=True, check=True).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(scratch, filter="data")
        path = scratch / FILE
    if not path.is_file():
        raise SystemExit(f"bench_cluster: no {FILE} in {folder} (a checkout, or a bare repository in repo/)")
    spec = importlib.util.spec_from_file_location("cluster_routing_authors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_layer(ours: ClusterRoutingConv, layer) -> None:
    with torch.no_grad():
        ours.conv.weight.copy_(torch.cat([layer.conv_trans[i].weight for i in range(ours.in_channels)]))
        ours.conv.bias.copy_(torch.cat([layer.conv_trans[i].bias for i in range(ours.in_channels)]))


def step(fn, x: torch.Tensor) -> float:
    """Seconds of one forward + backward of fn(x)."""
    x.grad = None
    start = time.perf_counter()
    out = fn(x)
    out.square().sum().backward()
    return time.perf_counter() - start


def compare(name: str, theirs, ours, x: torch.Tensor, repeats: int) -> bool:
    """Print one row: both sides' median step times and the ratio; False if the outputs differ."""
    with torch.no_grad():
        a, b = theirs(x), ours(x)
    diff = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
    for fn in (theirs, ours):  # warm-up
        step(fn, x)
    times: dict[str, list[float]] = {"theirs": [], "ours": []}
    for _ in range(repeats):
        times["theirs"].append(step(theirs, x))
        times["ours"].append(step(ours, x))
    t, o = statistics.median(times["theirs"]), statistics.median(times["ours"])
    n = x.shape[0]
    print(f"{name:8s} {n / t:10.1f} {n / o:10.1f} {t / o:8.2f}x {diff:12.1e}", flush=True)
    return diff <= 1e-4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--authors", type=Path, default=None, help="folder of the authors' repository")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--fc-batch-size", type=int, default=64, help="batch of the fc row (CapsNet trains at 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", default="", help="comma list of rows (caps1..caps5, model, fc)")
    a = p.parse_args(argv)
    if min(a.batch_size, a.fc_batch_size, a.repeats) < 1 or (a.threads is not None and a.threads < 1):
        p.error("--batch-size, --fc-batch-size, --repeats and --threads must be >= 1")
    folder = a.authors or Path(os.environ.get("CAPSNET_AUTHORS_CODE", ".")) / "ZHAOZHIHAO+ClusterRouting"
    if a.threads:
        torch.set_num_threads(a.threads)
    only = set(filter(None, a.only.split(",")))
    torch.manual_seed(0)
    ok = True
    with tempfile.TemporaryDirectory() as scratch:
        theirs = load_authors(folder, Path(scratch))
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {a.batch_size}, "
              f"median of {a.repeats}; img/s forward+backward")  # fmt: skip
        print(f"{'row':8s} {'authors':>10s} {'capsnet':>10s} {'speed-up':>9s} {'max rel diff':>12s}")
        net = theirs.CapsuleNetwork(ARGS)
        model = ClusterCapsNet()
        layers = [net.caps_layer1, net.caps_layer2, net.caps_layer3, net.caps_layer4, net.caps_layer5]
        for ours, layer in zip(model.capsules, layers, strict=True):
            copy_layer(ours, layer)
        with torch.no_grad():
            model.classifier.weight.copy_(net.classifier.weight)
            model.classifier.bias.copy_(net.classifier.bias)
        x = torch.randn(a.batch_size, 3, 32, 32)
        for k, (ours, layer) in enumerate(zip(model.capsules, layers), start=1):
            inp = x.detach().requires_grad_()
            if f"caps{k}" in only or not only:
                first = k == 1
                ok &= compare(f"caps{k}", lambda t, layer=layer, first=first: torch.stack(
                    layer(t if first else list(t.unbind(1))), dim=1), ours, inp, a.repeats)  # fmt: skip
            with torch.no_grad():
                x = ours(x)
        if "model" in only or not only:
            images = torch.randn(a.batch_size, 3, 32, 32, requires_grad=True)
            ok &= compare("model", net, lambda t: model.classifier(model(t).capsules).squeeze(-1), images, a.repeats)
        if "fc" in only or not only:
            fast = ClusterRoutingFC(1152, 10, 8, 16)
            slow = ClusterRoutingFC(1152, 10, 8, 16, fast=False)
            slow.load_state_dict(fast.state_dict())
            u = torch.randn(a.fc_batch_size, 1152, 8, requires_grad=True)
            print(f"fc (batch {a.fc_batch_size}): 'authors' is the same layer forming its K votes (fast=False)")
            ok &= compare("fc", slow, fast, u, a.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
