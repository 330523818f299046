"""How much does dynamic routing do in a trained CapsNet? Accuracy at other iteration counts, and coupling statistics.

    python benchmarks/routing_activity.py --checkpoint RUN_DIR [--dataset mnist-sample] [--split test]
                                          [--iterations 1,2,3,5] [--limit N]

Procedure 1 starts from uniform couplings c_ij = 1/out_caps (b = 0) and moves them by the agreements
b_ij += û_j|i · v_j, so it only changes the output when the agreements are large enough to move a softmax:
|û_j|i|·|v_j| of order 1. This script evaluates the same weights with r = 1 (no routing: uniform couplings),
r = 2, 3, ... and prints, for the model's own r:

- max_j c_ij (how concentrated each primary capsule's couplings are; 1/out_caps = uniform, 1 = one parent);
- the mean coupling to the true class (1/out_caps if routing ignores the class);
- |u_i|, |û_j|i| and the largest accumulated logit |b_ij| (≤ (r-1)·|û|·|v|), as quantiles.

If every r gives the same accuracy and max_j c_ij stays near 1/out_caps, routing is inert in that model: it acts as
r = 1, a fixed average of the votes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from capsnet.data import load_dataset
from capsnet.errors import CapsNetError
from capsnet.inference import preprocess
from capsnet.models.pretrained import load_pretrained
from capsnet.routing.dynamic import route_votes
from capsnet.training.checkpoint import resolve_checkpoint

QUANTILES = (0.1, 0.5, 0.9)


def quantiles(t: torch.Tensor) -> str:
    t = t.flatten().float()
    if t.numel() > 1_000_000:  # torch.quantile's input limit; a strided subsample is plenty
        t = t[:: t.numel() // 1_000_000 + 1]
    q = torch.quantile(t, torch.tensor(QUANTILES))
    return " / ".join(f"{x:.3f}" for x in q.tolist())


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run folder (uses best/) or save_pretrained folder")
    p.add_argument("--dataset", default="mnist-sample")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--split", choices=["test", "train"], default="test")
    p.add_argument("--iterations", default="1,2,3,5", help="comma-separated routing iteration counts to evaluate")
    p.add_argument("--limit", type=int, default=None, help="use only the first N images")
    p.add_argument("--batch-size", type=int, default=250)
    args = p.parse_args()
    try:
        iterations = [int(r) for r in args.iterations.split(",")]
        if not iterations or min(iterations) < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
            raise ValueError
    except ValueError:
        print(
            "error: --iterations takes positive integers like 1,2,3; --batch-size and --limit must be >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        model = load_pretrained(resolve_checkpoint(args.checkpoint), map_location="cpu").eval()
        data = load_dataset(args.dataset, data_dir=args.data_dir)
    except CapsNetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    router = getattr(model, "class_caps", None)
    if router is None:
        print(f"error: {args.checkpoint}: not a CapsNet checkpoint (no routed capsule layer)", file=sys.stderr)
        return 2
    split = data.test if args.split == "test" else data.train
    images, labels = split.images[: args.limit], split.labels[: args.limit]
    own_r = router.iterations
    batches = [
        (preprocess(model, images[i : i + args.batch_size]), labels[i : i + args.batch_size])
        for i in range(0, len(labels), args.batch_size)
    ]

    print(f"# {args.checkpoint}: trained with r = {own_r}; {data.name} {args.split}, {len(labels)} images")
    predictions = {}
    for r in sorted(set(iterations) | {1, own_r}):
        router.iterations = r
        predictions[r] = torch.cat([model(x).predictions for x, _ in batches])
    router.iterations = own_r
    print("r   accuracy   predictions that differ from r = 1")
    for r in sorted(predictions):
        acc = (predictions[r] == labels).float().mean().item()
        print(f"{r:<3d} {acc:.4f}     {(predictions[r] != predictions[1]).sum().item()}")

    u_norm, uhat_norm, c_max, c_true, b_max = [], [], [], [], []
    for x, y in batches:
        u = model.primary(torch.relu(model.conv1(x)))  # u_i  [B, in, in_d]
        _, c = router(u, return_coupling=True)  # c_ij after the last iteration  [B, in, out]
        u_hat = route_votes(router.weight, u)  # Eq. 2: û_j|i = W_ij u_i  [B, in, out, out_d]
        u_norm.append(u.norm(dim=-1))
        uhat_norm.append(u_hat.norm(dim=-1))
        c_max.append(c.max(dim=-1).values)
        c_true.append(c[torch.arange(len(y)), :, y])
        # log c_ij - log c_ik recovers b_ij up to a per-i constant; its spread over j bounds what routing moved
        logc = c.clamp_min(1e-30).log()
        b_max.append(logc.max(dim=-1).values - logc.min(dim=-1).values)
    n_out = router.out_caps
    print(f"quantiles {'/'.join(f'{q:g}' for q in QUANTILES)}")
    print(f"|u_i| (primary capsules)              {quantiles(torch.cat(u_norm))}")
    print(f"|û_j|i| (votes)                        {quantiles(torch.cat(uhat_norm))}")
    print(f"max_j b_ij - min_j b_ij (final logits) {quantiles(torch.cat(b_max))}")
    print(f"max_j c_ij (uniform: {1 / n_out:.3f})            {quantiles(torch.cat(c_max))}")
    print(f"mean c_i,true class (uniform: {1 / n_out:.3f})   {torch.cat(c_true).mean().item():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
