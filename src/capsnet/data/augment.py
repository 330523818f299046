"""Batch augmentation with plain torch ops (no torchvision), vectorized over the batch.

Both functions run on the device of `x` and are reproducible under a seeded `torch.Generator`
(random numbers are drawn on the generator's device, then moved to `x`'s).
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


def random_shift(x: torch.Tensor, max_shift: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Translate each image by its own random integer offset in [-max_shift, max_shift] on both axes.

    Pixels shifted in from outside are zero. This is the paper's only augmentation (max_shift=2).
    """
    if max_shift < 0:
        raise ValueError(f"max_shift must be >= 0, got {max_shift}")
    if max_shift == 0 or x.numel() == 0:
        return x
    xb, squeezed = _as_batch(x)
    b, _, h, w = xb.shape
    m = int(max_shift)
    device = generator.device if generator is not None else torch.device("cpu")
    shifts = torch.randint(-m, m + 1, (2, b), generator=generator, device=device).to(x.device)
    dy, dx = shifts[0], shifts[1]
    # Zero-pad by m, then gather output pixel (y, x) from padded (y - dy + m, x - dx + m): one
    # advanced-indexing op for the whole batch instead of a loop over images.
    padded = F.pad(xb, (m, m, m, m)).permute(0, 2, 3, 1)  # [B, H+2m, W+2m, C]
    rows = torch.arange(h, device=x.device)[None, :] - dy[:, None] + m  # [B, H]
    cols = torch.arange(w, device=x.device)[None, :] - dx[:, None] + m  # [B, W]
    batch = torch.arange(b, device=x.device)[:, None, None]
    out = padded[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()
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
    m = rot @ shear_m * zoom[:, None, None]
    # affine_grid wants the inverse, in normalized coordinates ([-1, 1] spans each image):
    # u_in = D_in^-1 M^-1 (D_out u_out - t), with D = diag(width/2, height/2).
    m_inv = torch.linalg.inv(m)
    d_in_inv = torch.diag(torch.tensor([2.0 / w, 2.0 / h], device=angle.device))
    d_out = torch.diag(torch.tensor([ow / 2.0, oh / 2.0], device=angle.device))
    lin = d_in_inv @ m_inv @ d_out
    shift = -(d_in_inv @ m_inv @ torch.stack([tx, ty], -1)[:, :, None])
    theta = torch.cat([lin, shift], -1).to(x.device)

    src = xb if xb.is_floating_point() else xb.float()
    grid = F.affine_grid(theta.to(src.dtype), [b, src.shape[1], oh, ow], align_corners=False)
    out = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if not xb.is_floating_point():
        info = torch.iinfo(xb.dtype)
        out = out.round_().clamp_(info.min, info.max).to(xb.dtype)
    return out.squeeze(1) if squeezed else out


__all__ = ["random_affine", "random_shift"]
