"""The training augmentation of Byerly, Kalganova & Dear (2021, homogeneous vector capsules) for MNIST-style images,
vectorized over the batch.

The authors' input pipeline (github.com/AdamByerly/BMCNNwHFCs, python/input: MNIST_input_pipeline.py and
input_pipeline_base.py, augmentation type 1) applies, to every training image and in this order:

    rotate   by 30° · clip(N(0, 0.33²), ±0.9999), to half the images (the others stay as they are)
    shift    by a fraction clip(|N(0, 0.33²)|, 0.9999) of the empty margin on a random side, on each axis: the
             object (its non-zero rows and columns) never leaves the image
    squish   the width by w = ⌊7 · clip(|N(0, 0.33²)|, 0.9999) + 1⌋ ∈ 1..7 pixels (28/4: a quarter of the side),
             placed ⌊w/2⌋ + (0 or 1) pixels from the left
    erase    a random 4×4 patch, its top-left corner uniform in rows and columns 4..22

Each function takes float images [B, C, H, W] in [0, 1] (background 0) and a `torch.Generator`; random numbers
are drawn on the generator's device and moved to the images'. Differences from the authors' code: bilinear
resampling (theirs: OpenCV bilinear for the rotation, Lanczos-3 with antialiasing for the squish), and rotation
about the image centre (H/2, W/2) in continuous coordinates.
"""

from __future__ import annotations

import torch

from .augment import affine_warp, place_on_canvas

SPREAD = 0.33  # the standard deviation of the authors' normal draws
CLIP = 0.9999  # and their clip


def _normal(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, device=gen_device).to(device) * SPREAD


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def hvc_rotate(x: torch.Tensor, degrees: float, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rotate half the images (each with probability 1/2) by degrees · clip(N(0, 0.33²), ±0.9999)."""
    if degrees == 0 or x.shape[0] == 0:
        return x
    r = _normal((2, x.shape[0]), generator, x.device).clamp(-CLIP, CLIP)
    angle = torch.deg2rad(r[0] * degrees)
    cos, sin = torch.cos(angle), torch.sin(angle)
    matrix = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # [B, 2, 2]
    rotated = affine_warp(x, matrix).clamp_(0.0, 1.0)
    return torch.where((r[1] <= 0)[:, None, None, None], rotated, x)  # the authors keep the image when r1 > 0


def _margins(ink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty lines before the first and after the last non-zero one. ink bool [B, L] -> (before [B], after [B]);
    an empty image has no margin to move in (0, 0)."""
    n = ink.shape[1]
    any_ink = ink.any(dim=1)
    first = ink.float().argmax(dim=1)
    last = n - 1 - ink.flip(1).float().argmax(dim=1)
    zero = torch.zeros_like(first)
    return torch.where(any_ink, first, zero), torch.where(any_ink, n - 1 - last, zero)


def hvc_shift(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Translate each image by a random share of its empty margins: per axis, a side drawn with probability 1/2
    and a fraction a = clip(|N(0, 0.33²)|, 0.9999): ⌊−a · before⌋ or ⌊a · (1 + after)⌋ pixels."""
    if x.shape[0] == 0:
        return x
    b, _, h, w = x.shape
    ink = x.detach() > 0
    top, bottom = _margins(ink.any(dim=1).any(dim=2))  # rows  [B]
    left, right = _margins(ink.any(dim=1).any(dim=1))  # columns  [B]
    amount = _normal((2, b), generator, x.device).abs().clamp(max=CLIP)  # [x, y]
    side = _uniform((2, b), generator, x.device) < 0.5  # [y, x] as the authors index them: True = up / left
    dx = torch.where(side[1], torch.floor(-amount[0] * left), torch.floor(amount[0] * (1 + right)))
    dy = torch.where(side[0], torch.floor(-amount[1] * top), torch.floor(amount[1] * (1 + bottom)))
    return place_on_canvas(x, dy.long(), dx.long(), (h, w))  # output (y, x) = input (y − dy, x − dx)


def hvc_squish(x: torch.Tensor, max_pixels: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Narrow each image by w = ⌊max_pixels · a + 1⌋ pixels (a = clip(|N(0, 0.33²)|, 0.9999)), full height, its
    left edge ⌊w/2⌋ + ⌊2 a'⌋ pixels in; what passes the right edge is cut off."""
    if max_pixels == 0 or x.shape[0] == 0:
        return x
    b, _, _, w = x.shape
    a = _normal((2, b), generator, x.device).abs().clamp(max=CLIP)
    narrow = torch.floor(a[0] * max_pixels + 1).clamp(max=w - 1)  # pixels taken off the width  [B]
    offset = torch.div(narrow, 2, rounding_mode="floor") + torch.floor(a[1] * 2)  # [B]
    scale = (w - narrow) / w
    # In centred coordinates: x_out = scale · x_in + offset + (scale − 1) · w/2 (left edge 0 → offset)
    ones, zeros = torch.ones_like(scale), torch.zeros_like(scale)
    matrix = torch.stack([torch.stack([scale, zeros], -1), torch.stack([zeros, ones], -1)], -2)  # [B, 2, 2]
    shift = torch.stack([offset + (scale - 1) * w / 2, zeros], -1)  # [B, 2]
    return affine_warp(x, matrix, shift).clamp_(0.0, 1.0)


def hvc_erase(x: torch.Tensor, side: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero one side×side patch per image, its top-left corner uniform in side..H−side−2 (rows) and likewise for
    the columns: 4..22 for 4×4 patches on 28×28 images, as the authors'."""
    if side == 0 or x.shape[0] == 0:
        return x
    b, _, h, w = x.shape
    u = _uniform((2, b), generator, x.device)
    top = torch.floor(u[0] * max(h - 2 * side - 1, 1)).long() + side  # [B]
    left = torch.floor(u[1] * max(w - 2 * side - 1, 1)).long() + side
    rows = torch.arange(h, device=x.device)[None, :] - top[:, None]  # [B, H]
    cols = torch.arange(w, device=x.device)[None, :] - left[:, None]  # [B, W]
    patch = ((rows >= 0) & (rows < side))[:, :, None] & ((cols >= 0) & (cols < side))[:, None, :]  # [B, H, W]
    return x.masked_fill(patch[:, None], 0.0)


def hvc_augment(
    x: torch.Tensor, *, rotate: float, shift: bool, squish: int, erase: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The authors' order: rotate, shift, squish, erase (each skipped at zero / False)."""
    x = hvc_rotate(x, rotate, generator=generator)
    if shift:
        x = hvc_shift(x, generator=generator)
    x = hvc_squish(x, squish, generator=generator)
    return hvc_erase(x, erase, generator=generator)


# The authors' MNIST values: rotate, shift, squish (28/4), erase.
PAPER = {"rotate": 30.0, "shift": True, "squish": 7, "erase": 4}
