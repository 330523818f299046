"""`capsnet export`: a trained model as an ONNX file (`.onnx`) or a torch.export program (`.pt2`), checked against
the PyTorch model (`capsnet.models.export`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..models.export import ATOL, OPSET, export_model
from ..models.inputs import image_hw
from ..models.pretrained import load_pretrained
from ..training.checkpoint import resolve_checkpoint
from .checkpoints import add_model_arguments, model_paths


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        description="Write the model as a graph from raw uint8 images [B, C, H, W] (the model's input recipe runs "
        "inside it) to the class-capsule lengths [B, n_classes] and the class capsules [B, n_classes, D] (the "
        "baseline CNN: its class probabilities), "
        "then check the file against the PyTorch model (onnxruntime for ONNX). ONNX needs the export extra: "
        "pip install 'capsnet[export]'.",
    )
    add_model_arguments(p)
    p.add_argument("--out", required=True, metavar="FILE", help="model.onnx (ONNX) or model.pt2 (torch.export)")
    p.add_argument("--opset", type=int, default=OPSET, help=f"ONNX opset (default: {OPSET})")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help=f"skip running the file and comparing its outputs with PyTorch's (tolerance {ATOL:g})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    (path,) = model_paths(args)
    model = load_pretrained(resolve_checkpoint(path))
    info = export_model(model, args.out, opset=args.opset, check=args.check)
    if args.json:
        print(json.dumps(info))
        return 0
    cfg: Any = model.config
    shape = ", ".join(map(str, (cfg.in_channels, *image_hw(cfg.image_size))))
    outputs = ", ".join(f"{name} [{', '.join(map(str, dims))}]" for name, dims in info["outputs"].items())
    opset = f" opset {info['opset']}" if "opset" in info else ""
    print(
        f"wrote {info['path']}: {info['format']}{opset}, input images [batch, {shape}] (batch dynamic), "
        f"outputs {outputs}"
    )
    if "max_abs_diff" in info:
        runner = "onnxruntime" if info["format"] == "ONNX" else "torch.export.load"
        print(f"checked: {runner} matches the PyTorch model within {info['max_abs_diff']:.2g} (tolerance {ATOL:g})")
    return 0
