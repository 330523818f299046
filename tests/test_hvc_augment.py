"""Byerly et al.'s MNIST augmentation (capsnet.data.hvc_augment) and its `--augment` spelling: each operation's
range as the authors' code draws it, identity cases, determinism, and parsing."""

from __future__ import annotations

import pytest
import torch

from capsnet.data.hvc_augment import hvc_augment, hvc_erase, hvc_rotate, hvc_shift, hvc_squish
from capsnet.data.imageaug import AugmentSpec
from capsnet.errors import ConfigError


def objects(b: int = 64) -> torch.Tensor:
    """A 6×9 block at rows 8..13, columns 5..13: margins top 8, bottom 14, left 5, right 14."""
    x = torch.zeros(b, 1, 28, 28)
    x[:, :, 8:14, 5:14] = 1.0
    return x


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_shift_moves_within_the_margins():
    x = objects(400)
    out = hvc_shift(x, generator=gen())
    assert torch.equal(out.sum(dim=(1, 2, 3)), x.sum(dim=(1, 2, 3)))  # whole-pixel moves, nothing cut off
    rows = out[:, 0].amax(dim=2)  # [B, H]
    cols = out[:, 0].amax(dim=1)  # [B, W]
    dy = rows.argmax(dim=1) - 8
    dx = cols.argmax(dim=1) - 5
    # up to the whole margin: floor(−a · before) ≥ −before, floor(a · (1 + after)) ≤ after
    assert dy.min() >= -8 and dy.max() <= 14 and dx.min() >= -5 and dx.max() <= 14
    assert (dy < 0).any() and (dy > 0).any() and (dx < 0).any() and (dx > 0).any()
    # a = |N(0, 0.33²)|: most moves are small, a third of the margin or less
    assert ((dx.abs() <= 5).float().mean() > 0.7) and (dx == 0).float().mean() < 0.5
    assert torch.equal(out, hvc_shift(x, generator=gen()))  # reproducible
    empty = torch.zeros(3, 1, 28, 28)
    assert torch.equal(hvc_shift(empty, generator=gen()), empty)  # no ink: no margin, no move


def test_erase_zeroes_one_square_in_the_authors_range():
    x = torch.ones(300, 1, 28, 28)
    out = hvc_erase(x, 4, generator=gen())
    zeros = out[:, 0] == 0
    assert torch.equal(zeros.sum(dim=(1, 2)), torch.full((300,), 16))
    top = zeros.any(dim=2).float().argmax(dim=1)
    left = zeros.any(dim=1).float().argmax(dim=1)
    assert top.min() == 4 and top.max() == 22 and left.min() == 4 and left.max() == 22  # floor(u · 19) + 4
    assert torch.equal(hvc_erase(x, 0, generator=gen()), x)


def test_squish_narrows_by_1_to_7_pixels_and_keeps_the_height():
    x = torch.ones(500, 1, 28, 28)
    out = hvc_squish(x, 7, generator=gen())
    row = out[:, 0, 14]  # one row: the squished image's width, blurred at its two edges
    width = row.sum(dim=1)  # ≈ 28 − w
    assert width.min() >= 28 - 7 - 1 and width.max() <= 27 + 0.5
    assert (out[:, 0] > 0.5).any(dim=2).all()  # every row still has content: the height is kept
    narrowed = (28 - width).round()
    assert set(narrowed.tolist()) <= set(range(0, 9)) and (narrowed >= 5).any() and (narrowed <= 2).any()
    left = (row > 0.5).float().argmax(dim=1)  # the left edge ⌊w/2⌋ + 0 or 1 pixels in
    assert set((left - torch.div(narrowed, 2, rounding_mode="floor")).tolist()) == {0.0, 1.0}
    assert torch.equal(hvc_squish(x, 0, generator=gen()), x)


def test_rotate_turns_half_the_images_by_at_most_30_degrees():
    x = torch.zeros(400, 1, 28, 28)
    x[:, :, 13:15, 4:24] = 1.0  # a horizontal bar through the centre
    out = hvc_rotate(x, 30.0, generator=gen())
    unchanged = (out == x).flatten(1).all(dim=1)
    assert 0.4 < unchanged.float().mean() < 0.6  # the authors keep the image when their second draw is > 0
    # the bar's slope from the ink's second moments: |angle| ≤ 30°
    ys, xs = torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")
    w = out[:, 0]
    m = w.sum(dim=(1, 2))
    cy, cx = (w * ys).sum(dim=(1, 2)) / m, (w * xs).sum(dim=(1, 2)) / m
    cov_xy = (w * (xs - cx[:, None, None]) * (ys - cy[:, None, None])).sum(dim=(1, 2))
    cov_xx = (w * (xs - cx[:, None, None]) ** 2).sum(dim=(1, 2))
    cov_yy = (w * (ys - cy[:, None, None]) ** 2).sum(dim=(1, 2))
    angle = torch.rad2deg(0.5 * torch.atan2(2 * cov_xy, cov_xx - cov_yy)).abs()
    assert angle[~unchanged].max() <= 30.5 and angle[~unchanged].max() > 15 and angle[unchanged].max() < 1e-3
    assert torch.equal(hvc_rotate(x, 0.0, generator=gen()), x)


def test_the_pipeline_is_reproducible_and_stays_in_range():
    x = objects(16) * 0.8
    a = hvc_augment(x, rotate=30, shift=True, squish=7, erase=4, generator=gen(3))
    b = hvc_augment(x, rotate=30, shift=True, squish=7, erase=4, generator=gen(3))
    assert torch.equal(a, b) and a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    assert not torch.equal(a, hvc_augment(x, rotate=30, shift=True, squish=7, erase=4, generator=gen(4)))
    assert torch.equal(hvc_augment(x, rotate=0, shift=False, squish=0, erase=0, generator=gen()), x)


def test_augment_spec_spells_the_authors_pipeline():
    spec = AugmentSpec.parse("hvc")
    assert (spec.hvc_rotate, spec.hvc_shift, spec.hvc_squish, spec.hvc_erase) == (30.0, True, 7, 4)
    assert str(spec) == "hvc" and str(AugmentSpec.parse("hvc,flip")) == "hvc,flip"
    parts = AugmentSpec.parse("hvc-rotate=15,hvc-shift,hvc-erase=3")
    assert str(parts) == "hvc-rotate=15,hvc-shift,hvc-erase=3" and AugmentSpec.parse(str(parts)) == parts
    x = objects(8)
    torch.testing.assert_close(spec(x, gen(1)), hvc_augment(x, rotate=30, shift=True, squish=7, erase=4,
                                                            generator=gen(1)))  # fmt: skip


@pytest.mark.parametrize("text", ["hvc-rotate=x", "hvc-squish=-1", "hvc-erase=2.5", "hvc-shift=3"])
def test_bad_hvc_items_are_config_errors(text):
    with pytest.raises(ConfigError):
        AugmentSpec.parse(text)
