"""place_on_canvas / affine_warp and the augmentations built on them (random_shift / random_affine): literal
references, shapes, ranges, real movement, identity cases, determinism."""

from __future__ import annotations

import pytest
import torch

from capsnet.data import random_affine, random_shift
from capsnet.data.augment import affine_warp, border_fill, place_on_canvas
from capsnet.data.datasets import load_dataset


def blobs(b: int = 16, size: int = 28) -> torch.Tensor:
    """Float images with one bright square, away from the border so shifts never clip it."""
    x = torch.zeros(b, 1, size, size)
    x[:, :, 10:16, 11:18] = 1.0
    return x


def centre_of_mass(x: torch.Tensor) -> torch.Tensor:
    """[B, 2] (row, col) centre of mass of each image."""
    w = x.sum(dim=(1,))  # [B, H, W]
    rows = torch.arange(x.shape[-2], dtype=x.dtype)[None, :, None]
    cols = torch.arange(x.shape[-1], dtype=x.dtype)[None, None, :]
    total = w.sum(dim=(1, 2))
    return torch.stack([(w * rows).sum(dim=(1, 2)) / total, (w * cols).sum(dim=(1, 2)) / total], -1)


def test_shift_moves_by_at_most_max_shift():
    x = blobs(64)
    out = random_shift(x, 2, generator=torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out.sum(dim=(1, 2, 3)), x.sum(dim=(1, 2, 3)))  # nothing clipped, nothing invented
    delta = centre_of_mass(out) - centre_of_mass(x)
    assert torch.allclose(delta, delta.round())  # integer shifts
    assert delta.abs().max() <= 2
    assert (delta.abs().sum(-1) > 0).float().mean() > 0.5  # most images actually moved
    assert len({tuple(d.tolist()) for d in delta}) > 10  # each image its own offset


def test_shift_zero_fill_pads_with_zeros_and_keeps_uint8():
    x = torch.full((4, 1, 5, 5), 255, dtype=torch.uint8)
    out = random_shift(x, 3, generator=torch.Generator().manual_seed(1), fill="zero")
    assert out.dtype == torch.uint8 and out.shape == x.shape
    assert set(out.unique().tolist()) <= {0, 255}
    assert (out == 0).any()
    with pytest.raises(ValueError, match="fill must be"):
        random_shift(x, 3, fill="black")


def test_shift_border_fill_continues_a_coloured_background():
    # A coloured backdrop (per channel 200, 30, 90) with a dark square: what shifts in is the backdrop, never black.
    x = torch.tensor([200, 30, 90], dtype=torch.uint8)[None, :, None, None].repeat(6, 1, 12, 12)
    x[:, :, 4:8, 4:8] = 5
    out = random_shift(x, 3, generator=torch.Generator().manual_seed(2))
    assert out.dtype == torch.uint8
    assert torch.equal(out.flatten(2).sum(2), x.flatten(2).sum(2))  # the square never clips: only backdrop moves
    assert set(out[:, 0].unique().tolist()) == {5, 200} and set(out[:, 1].unique().tolist()) == {5, 30}


def test_border_fill_is_the_median_of_the_outermost_ring():
    x = torch.rand(3, 2, 7, 9)
    for b in range(3):
        for c in range(2):
            img = x[b, c]
            ring = torch.cat([img[0], img[-1], img[1:-1, 0], img[1:-1, -1]])
            assert ring.numel() == 2 * 7 + 2 * 9 - 4
            assert border_fill(x)[b, c] == ring.median()


def test_border_fill_is_the_papers_zero_padding_on_every_bundled_digit():
    data = load_dataset("mnist-sample")
    digits = torch.cat([data.train.images, data.test.images])
    assert digits.shape[0] == 8000 and (border_fill(digits) == 0).all()
    x = digits[:256]
    border = random_shift(x, 2, generator=torch.Generator().manual_seed(3))
    zero = random_shift(x, 2, generator=torch.Generator().manual_seed(3), fill="zero")
    assert torch.equal(border, zero)


def test_shift_identity_and_determinism():
    x = blobs(8)
    assert random_shift(x, 0) is x
    a = random_shift(x, 2, generator=torch.Generator().manual_seed(7))
    b = random_shift(x, 2, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert random_shift(x[:, 0], 2).shape == (8, 28, 28)  # [B, H, W] accepted too
    with pytest.raises(ValueError):
        random_shift(x, -1)


def test_affine_identity():
    x = torch.rand(5, 1, 28, 28)
    out = random_affine(x)
    assert out.shape == x.shape
    assert torch.allclose(out, x, atol=1e-5)
    u8 = (x * 255).to(torch.uint8)
    assert torch.equal(random_affine(u8), u8)


def test_affine_range_determinism_and_motion():
    x = blobs(16)
    kw = {"degrees": 15.0, "scale": (0.9, 1.1), "shear": 10.0, "translate": 0.1}
    a = random_affine(x, generator=torch.Generator().manual_seed(3), **kw)
    b = random_affine(x, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b) and a.shape == x.shape
    assert float(a.min()) >= 0 and float(a.max()) <= 1 + 1e-6
    assert not torch.allclose(a, x, atol=1e-3)
    moved = centre_of_mass(
        random_affine(x, translate=0.1, generator=torch.Generator().manual_seed(0))
    ) - centre_of_mass(x)
    assert moved.abs().max() <= 0.1 * 28 + 1e-3 and moved.abs().max() > 0.5


def test_affine_out_size_places_digit_on_canvas():
    x = blobs(3)
    out = random_affine(x, out_size=36)
    assert out.shape == (3, 1, 36, 36)
    assert torch.allclose(out.sum(dim=(1, 2, 3)), x.sum(dim=(1, 2, 3)), atol=1e-3)  # same pixel scale
    assert torch.allclose(centre_of_mass(out), centre_of_mass(x) + 4, atol=1e-3)  # centred: (36-28)/2


def _place_loop(
    x: torch.Tensor, top: list[int], left: list[int], height: int, width: int, fill: torch.Tensor | None = None
) -> torch.Tensor:
    """The literal definition: canvas pixel (y, x) = image pixel (y - top, x - left) where that exists, else the
    image's fill [B, C] (0 without one)."""
    b, c, h, w = x.shape
    out = torch.zeros(b, c, height, width, dtype=x.dtype)
    if fill is not None:
        out += fill[:, :, None, None]
    for k in range(b):
        for y in range(height):
            for q in range(width):
                if 0 <= y - top[k] < h and 0 <= q - left[k] < w:
                    out[k, :, y, q] = x[k, :, y - top[k], q - left[k]]
    return out


def test_place_on_canvas_matches_the_literal_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 256, (6, 2, 5, 7), generator=g, dtype=torch.uint8)
    top, left = [0, -3, 4, 9, -6, 2], [1, 6, -2, 0, -8, 11]  # inside, cut on each side, fully outside
    for size in (9, (8, 12), (5, 7)):
        height, width = (size, size) if isinstance(size, int) else size
        out = place_on_canvas(x, torch.tensor(top), torch.tensor(left), size)
        assert out.dtype == torch.uint8 and out.shape == (6, 2, height, width)
        assert torch.equal(out, _place_loop(x, top, left, height, width))
    assert place_on_canvas(x[:, 0], torch.tensor(top), torch.tensor(left), 9).shape == (6, 9, 9)  # [B, H, W]


def test_random_shift_is_a_placement_on_a_same_size_canvas():
    x = torch.rand(32, 1, 6, 9)
    out = random_shift(x, 3, generator=torch.Generator().manual_seed(4), fill="zero")
    dy, dx = torch.randint(-3, 4, (2, 32), generator=torch.Generator().manual_seed(4))  # the same draw
    assert torch.equal(out, _place_loop(x, dy.tolist(), dx.tolist(), 6, 9))
    out = random_shift(x, 3, generator=torch.Generator().manual_seed(4))  # border fill: the canvas is each backdrop
    assert torch.equal(out, _place_loop(x, dy.tolist(), dx.tolist(), 6, 9, fill=border_fill(x)))


def test_affine_warp_identity_translation_and_canvas():
    x = torch.rand(4, 2, 10, 10, dtype=torch.float64)
    eye = torch.eye(2, dtype=torch.float64).repeat(4, 1, 1)
    assert torch.allclose(affine_warp(x, eye), x, atol=1e-12)
    # A whole-pixel translation (x right, y down) is an exact placement.
    t = torch.tensor([[2.0, 0.0], [0.0, -3.0], [1.0, 1.0], [-4.0, 2.0]], dtype=torch.float64)
    moved = affine_warp(x, eye, t)
    expected = place_on_canvas(x, t[:, 1].long(), t[:, 0].long(), 10)
    assert torch.allclose(moved, expected, atol=1e-12)
    # A larger canvas centres the image at its own pixel scale.
    canvas = affine_warp(x, eye, out_size=16)
    assert canvas.shape == (4, 2, 16, 16) and torch.allclose(canvas[:, :, 3:13, 3:13], x, atol=1e-12)
    assert canvas.sum() == pytest.approx(x.sum().item())
    # A 90° rotation about the centre: p_out = R p_in with R = [[0, -1], [1, 0]] (x right, y down).
    rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64).repeat(4, 1, 1)
    assert torch.allclose(affine_warp(x, rot), torch.rot90(x, k=-1, dims=(2, 3)), atol=1e-12)
    u8 = (x * 255).to(torch.uint8)
    assert torch.equal(affine_warp(u8, eye), u8)
