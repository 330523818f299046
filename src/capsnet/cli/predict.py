"""`capsnet predict`: classify PNG or JPEG images of any size with a trained model."""

from __future__ import annotations

import argparse
import json

from .checkpoints import add_model_arguments, model_paths


def register(subparsers) -> None:
    p = subparsers.add_parser("predict")
    add_model_arguments(p)
    p.add_argument("images", nargs="+", metavar="IMAGE", help="PNG or JPEG files, any size")
    p.add_argument("--json", action="store_true", help="print one JSON object per image")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..inference import predict
    from ..models.pretrained import load_pretrained
    from ..training.checkpoint import resolve_checkpoint

    (path,) = model_paths(args)
    model = load_pretrained(resolve_checkpoint(path))
    for r in predict(model, args.images).rows(args.images):
        if args.json:
            print(json.dumps(r))
        else:
            lengths = " ".join(f"{j}:{x:.3f}" for j, x in enumerate(r["lengths"]))
            name = f" ({r['name']})" if r["name"] != str(r["class"]) else ""
            print(f"{r['image']}: class {r['class']}{name}  (capsule lengths {lengths}; input: {r['conversion']})")
    return 0
