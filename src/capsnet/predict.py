"""`capsnet predict`: classify PNG or JPEG images of any size with a trained model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .checkpoint import resolve_checkpoint
from .errors import CapsNetError, DatasetError
from .persist import load_pretrained


def load_image(path: str | Path, *, size: int = 28, channels: int = 1) -> torch.Tensor:
    """Read an image into the model's input [C, size, size] in [0, 1], MNIST-style.

    Light-background images (dark ink on white paper) are inverted to MNIST's white-on-black; the content is
    scaled to fit a box of 20/28 of the side, keeping its aspect ratio, and centred, as MNIST's digits are.
    """
    try:
        from PIL import Image, ImageOps, UnidentifiedImageError
    except ImportError:
        raise CapsNetError("capsnet predict needs Pillow: pip install 'capsnet[images]'") from None
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such image file")
    try:
        with Image.open(path) as im:
            im.load()
            img = im.convert("L" if channels == 1 else "RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise DatasetError(f"{path}: not a readable PNG or JPEG image ({e})") from None
    gray = img if img.mode == "L" else img.convert("L")
    w, h = gray.size
    border = [gray.getpixel((x, y)) for x in range(w) for y in (0, h - 1)]
    border += [gray.getpixel((x, y)) for y in range(h) for x in (0, w - 1)]
    if sum(border) / len(border) > 127:  # light background: invert to white ink on black
        img = ImageOps.invert(img)
    inner = max(1, round(size * 20 / 28))
    scale = inner / max(w, h)
    img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)
    canvas = Image.new(img.mode, (size, size))
    canvas.paste(img, ((size - img.size[0]) // 2, (size - img.size[1]) // 2))
    x = torch.frombuffer(bytearray(canvas.tobytes()), dtype=torch.uint8).float().div_(255.0)
    return x.view(size, size, channels).permute(2, 0, 1).contiguous()


@torch.no_grad()
def predict(model: torch.nn.Module, images: list[str | Path]) -> list[dict]:
    cfg = model.config
    batch = torch.stack([load_image(p, size=cfg.image_size, channels=cfg.in_channels) for p in images])
    out = model.eval()(batch)
    return [
        {"image": str(p), "class": int(c), "lengths": [round(float(x), 6) for x in row]}
        for p, c, row in zip(images, out.predictions.tolist(), out.lengths.tolist())
    ]


def register(subparsers) -> None:
    p = subparsers.add_parser("predict", help="classify PNG or JPEG images with a trained model")
    p.add_argument("--checkpoint", required=True, help="run folder (uses best/) or save_pretrained folder")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="PNG or JPEG files, any size")
    p.add_argument("--json", action="store_true", help="print one JSON object per image")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load_pretrained(resolve_checkpoint(args.checkpoint))
    for r in predict(model, args.images):
        if args.json:
            print(json.dumps(r))
        else:
            lengths = " ".join(f"{j}:{x:.3f}" for j, x in enumerate(r["lengths"]))
            print(f"{r['image']}: class {r['class']}  (capsule lengths {lengths})")
    return 0
