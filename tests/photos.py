"""Photos of digits made in the tests: a clean MNIST digit (white ink on black, 28×28) rendered as dark ink on
off-white paper of a random colour, under uneven light (a gradient and a vignette), blurred by the lens, with
sensor noise, saved as JPEG, the digit off-centre at 40–60% of the frame, frames of 64 to 400 pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def photo(digit: np.ndarray, rng: np.random.Generator, *, side: int | None = None, fraction=(0.4, 0.6)) -> np.ndarray:
    """A photo of `digit` ([28, 28] uint8, white on black) as an RGB uint8 array [H, W, 3], `side` pixels high
    (random in 64..400 if None), the digit's height a `fraction` of the frame (random in that range)."""
    from PIL import Image, ImageFilter

    h = side or int(rng.integers(64, 401))
    w = round(h * rng.uniform(0.75, 1.33))
    rows, cols = np.flatnonzero(digit.any(1)), np.flatnonzero(digit.any(0))
    ink = digit[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1].astype(np.float32) / 255  # the digit's ink, cropped
    scale = rng.uniform(*fraction) * min(h, w) / ink.shape[0]
    dh, dw = max(1, round(ink.shape[0] * scale)), max(1, round(ink.shape[1] * scale))
    ink = np.clip(np.asarray(Image.fromarray(ink).resize((dw, dh), Image.Resampling.BICUBIC)), 0, 1)
    alpha = np.zeros((h, w), np.float32)
    top, left = int(rng.integers(0, h - dh + 1)), int(rng.integers(0, w - dw + 1))  # anywhere in the frame
    alpha[top : top + dh, left : left + dw] = ink
    paper = rng.uniform(0.78, 0.97) + rng.uniform(-0.04, 0.04, size=3)  # off-white, tinted
    pen = rng.uniform(0.02, 0.25) + rng.uniform(-0.03, 0.03, size=3)  # dark ink, of some colour
    rgb = paper * (1 - alpha[..., None]) + pen * alpha[..., None]
    y, x = np.mgrid[0 : 1 : h * 1j, 0 : 1 : w * 1j]
    angle, depth = rng.uniform(0, 2 * np.pi), rng.uniform(0.1, 0.4)  # light falling off across the sheet
    gradient = 1 - depth * (0.5 + ((x - 0.5) * np.cos(angle) + (y - 0.5) * np.sin(angle)))
    cy, cx, spread = rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.8), rng.uniform(0.5, 1.2)
    vignette = 1 - 0.25 * ((x - cx) ** 2 + (y - cy) ** 2) / spread
    rgb = rgb * (gradient * vignette)[..., None]
    img = Image.fromarray(np.clip(rgb * 255, 0, 255).astype(np.uint8))
    img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0) * min(h, w) / 100))  # the lens
    noisy = np.asarray(img, np.float32) + rng.normal(0, rng.uniform(2, 8), size=(h, w, 3))  # the sensor
    return np.clip(noisy, 0, 255).astype(np.uint8)


def write_photos(folder: Path, digits: np.ndarray, *, seed: int = 0) -> list[Path]:
    """Each digit of `digits` [N, 28, 28] uint8 as a JPEG photo (quality 50–90) in `folder`, in order."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, digit in enumerate(digits):
        path = folder / f"photo{i:04d}.jpg"
        Image.fromarray(photo(digit, rng)).save(path, quality=int(rng.integers(50, 91)))
        paths.append(path)
    return paths
