"""Batch augmentation with plain torch ops (no torchvision), vectorized over the batch.

Two geometric primitives, used by the augmentations here and by the experiments' data (MultiMNIST pairs, expanded
MNIST, the affNIST-style test set): `place_on_canvas` (integer translation, one gather) and
`affine_warp` (bilinear affine warp). The random functions run on the device of `x` and are reproducible
under a seeded `torch.Generator` (random numbers are drawn on the generator's device, then moved to `x`'s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _as_batch(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Accept [B, C, H, W] or [B, H, W]; return a 4-d view and whether a channel dim was added."""
    if x.dim() == 3:
        return x.unsqueeze(1), True
    if x.dim() != 4:
        raise ValueError(f"expected images of shape [B, C, H, W] or [B, H, W], got {tuple(x.shape)}")
    return x, False


def _uniform(n: int, low: float, high: float, generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(n, generator=generator, device=device) * (high - low) + low


def border_fill(x: torch.Tensor) -> torch.Tensor:
    """Each image's background as its own border shows it: the per-channel median of its outermost pixels.
    x [B, C, H, W] -> [B, C]. An MNIST digit's is 0 (every one of the bundled 8,000), so filling with it is the
    paper's zero padding there; a photo's or a drawing's is its paper or backdrop colour, not black."""
    ring = torch.cat([x[:, :, 0, :], x[:, :, -1, :], x[:, :, 1:-1, 0], x[:, :, 1:-1, -1]], dim=2)  # [B, C, 2H+2W-4]
    return ring.median(dim=2).values


def place_on_canvas(
    x: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    size: int | tuple[int, int],
    *,
    fill: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paste each image x[b] [C, h, w] with its top-left corner at (top[b], left[b]) of a canvas of `fill`.

    x [B, C, h, w] or [B, h, w]; top, left int [B], any values (parts falling outside the canvas are cut off);
    size: the canvas side, or (height, width); fill: the canvas colour per image and channel [B, C] (None: black).
    Returns [B, C, height, width] (or [B, height, width]). One gather for the whole batch: canvas pixel (y, x) reads
    image pixel (y - top, x - left), `fill` outside.
    """
    xb, squeezed = _as_batch(x)
    b, _, h, w = xb.shape
    height, width = (size, size) if isinstance(size, int) else size
    top, left = top.to(x.device).long(), left.to(x.device).long()
    rows = torch.arange(height, device=x.device)[None, :] - top[:, None]  # image row of each canvas row  [B, H]
    cols = torch.arange(width, device=x.device)[None, :] - left[:, None]  # image column of each canvas column  [B, W]
    inside = ((rows >= 0) & (rows < h))[:, :, None, None] & ((cols >= 0) & (cols < w))[:, None, :, None]
    batch = torch.arange(b, device=x.device)[:, None, None]
    pixels = xb.permute(0, 2, 3, 1)[batch, rows.clamp(0, h - 1)[:, :, None], cols.clamp(0, w - 1)[:, None, :]]
    background = pixels.new_zeros(()) if fill is None else fill.to(pixels.dtype)[:, None, None, :]  # [B, 1, 1, C]
    out = torch.where(inside, pixels, background).permute(0, 3, 1, 2).contiguous()  # [B, C, H, W]
    return out.squeeze(1) if squeezed else out


def random_shift(
    x: torch.Tensor, max_shift: int, *, generator: torch.Generator | None = None, fill: str = "border"
) -> torch.Tensor:
    """Translate each image by its own random integer offset in [-max_shift, max_shift] on both axes (the paper's
    only augmentation, max_shift=2, §5).

    Pixels shifted in from outside take `fill`: "border", the image's own background (`border_fill`: 0 for
    every MNIST digit, where this is the paper's zero padding), or "zero". Zeros on a coloured background draw a
    black bar of a random width along two sides of every training image, which stopped every model learning an easy
    set of coloured shapes (docs/fidelity.md, "Shift padding").
    """
    if fill not in ("border", "zero"):
        raise ValueError(f"fill must be 'border' or 'zero', got {fill!r}")
    if max_shift < 0:
        raise ValueError(f"max_shift must be >= 0, got {max_shift}")
    if max_shift == 0 or x.numel() == 0:
        return x
    xb, squeezed = _as_batch(x)
    b, _, h, w = xb.shape
    m = int(max_shift)
    device = generator.device if generator is not None else torch.device("cpu")
    shifts = torch.randint(-m, m + 1, (2, b), generator=generator, device=device).to(x.device)
    background = border_fill(xb) if fill == "border" else None
    out = place_on_canvas(xb, shifts[0], shifts[1], (h, w), fill=background)  # pixel (y, x) = input (y - dy, x - dx)
    return out.squeeze(1) if squeezed else out


def random_affine(
    x: torch.Tensor,
    *,
    degrees: float = 0.0,
    scale: tuple[float, float] = (1.0, 1.0),
    shear: float = 0.0,
    translate: float = 0.0,
    out_size: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random rotation, scaling, shear and translation per image, with bilinear sampling and zero padding.

    degrees: rotation drawn from [-degrees, degrees]; scale: zoom factor drawn from [scale[0], scale[1]];
    shear: x-shear angle in degrees drawn from [-shear, shear]; translate: offset drawn from
    [-translate, translate] times the output size, per axis. out_size: side of a (larger or smaller)
    square output canvas; the image is placed at its centre at its own pixel scale.
    Integer inputs come back rounded to the same dtype; float inputs stay float.
    """
    xb, squeezed = _as_batch(x)
    b, _, h, w = xb.shape
    oh, ow = (out_size, out_size) if out_size is not None else (h, w)
    if b == 0:
        return xb.new_zeros((0, xb.shape[1], oh, ow))

    angle = torch.deg2rad(_uniform(b, -degrees, degrees, generator))
    zoom = _uniform(b, scale[0], scale[1], generator)
    sh = torch.tan(torch.deg2rad(_uniform(b, -shear, shear, generator)))
    tx = _uniform(b, -translate, translate, generator) * ow
    ty = _uniform(b, -translate, translate, generator) * oh

    # Forward map in centred pixel coordinates: p_out = M p_in + t with M = rotation · shear · zoom.
    cos, sin = torch.cos(angle), torch.sin(angle)
    rot = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    shear_m = torch.eye(2, device=angle.device).repeat(b, 1, 1)
    shear_m[:, 0, 1] = sh
    out = affine_warp(xb, rot @ shear_m * zoom[:, None, None], torch.stack([tx, ty], -1), out_size=out_size)
    return out.squeeze(1) if squeezed else out


def affine_warp(
    x: torch.Tensor, matrix: torch.Tensor, translation: torch.Tensor | None = None, *, out_size: int | None = None
) -> torch.Tensor:
    """Warp each image x[b] [C, h, w] by its own affine map p_out = M_b p_in + t_b (bilinear, zero outside).

    Points p are pixel coordinates (x right, y down) centred on each image; matrix [B, 2, 2], translation
    [B, 2] in pixels (x, y) or None. out_size: side of a square output canvas (default: the input size), the
    image at its centre at its own pixel scale. The sampling grid is computed in `matrix`'s dtype.
    Integer inputs come back rounded to the same dtype; float inputs stay float.
    """
    b, _, h, w = x.shape
    oh, ow = (out_size, out_size) if out_size is not None else (h, w)
    if b == 0:
        return x.new_zeros((0, x.shape[1], oh, ow))
    # affine_grid wants the inverse, in normalized coordinates ([-1, 1] spans each image):
    # u_in = D_in⁻¹ M⁻¹ (D_out u_out - t), with D = diag(width/2, height/2).
    m_inv = torch.linalg.inv(matrix)  # [B, 2, 2]
    ratio = torch.tensor([[ow / w, oh / w], [ow / h, oh / h]], dtype=matrix.dtype, device=matrix.device)
    lin = m_inv * ratio  # D_in⁻¹ M⁻¹ D_out: entry (i, j) scaled by out_j / in_i
    if translation is None:
        shift = torch.zeros(b, 2, 1, dtype=matrix.dtype, device=matrix.device)
    else:
        d_in_inv = torch.tensor([2.0 / w, 2.0 / h], dtype=matrix.dtype, device=matrix.device)
        shift = -(d_in_inv[:, None] * (m_inv @ translation.to(matrix)[:, :, None]))
    theta = torch.cat([lin, shift], -1).to(x.device)  # [B, 2, 3]

    src = x if x.is_floating_point() else x.float()
    grid = F.affine_grid(theta.to(src.dtype), [b, src.shape[1], oh, ow], align_corners=False)
    out = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if not x.is_floating_point():
        info = torch.iinfo(x.dtype)
        out = out.round_().clamp_(info.min, info.max).to(x.dtype)
    return out


# The affine test of the results data and `capsnet compare`: each test image under its own random rotation, scale,
# shear and translation, drawn once from a generator seeded AFFINE_TEST_SEED, so every model sees the same images.
AFFINE_TEST = {"degrees": 15.0, "scale": (0.9, 1.1), "shear": 10.0, "translate": 0.1}
AFFINE_TEST_SEED = 0


def affine_test_images(images: torch.Tensor) -> torch.Tensor:
    """`images` (uint8 [N, C, H, W]) under AFFINE_TEST, the same draw on every call; uint8 in, uint8 out."""
    generator = torch.Generator().manual_seed(AFFINE_TEST_SEED)
    return random_affine(images, **AFFINE_TEST, generator=generator)  # type: ignore[arg-type]


__all__ = [
    "AFFINE_TEST",
    "affine_test_images",
    "affine_warp",
    "border_fill",
    "place_on_canvas",
    "random_affine",
    "random_shift",
]
