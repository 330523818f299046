"""LeCun et al.'s MNIST procedure as one conversion: a picture of a digit (a photo of ink on paper, or white ink on
black of any size) into MNIST's form, white ink on black, fitted in a 20×20 box and centred by its centre of mass
in 28×28. NumPy and Pillow only; docs/inputs.md gives the same steps for a deployment of an exported graph.

The steps, on the image's grey levels g in [0, 1] (larger images first reduced to `WORK_SIDE`):

1. Polarity: the ink is where the image departs from the median around it (the paper, a shadow's edge
   included); images whose ink is lighter than that are flipped (g ← 1 − g), so that the paper is light.
2. The paper, uneven light included: a morphological closing (max filter, then min filter) wider than the ink's
   strokes, between two 3×3 box blurs, on a copy at most `BACKGROUND_SIDE` pixels wide, resized back: paper [H, W].
3. The ink: its darkness relative to the paper, ink = clip((paper − g) / paper, 0, 1) (light falls on paper and
   ink alike, so the ratio removes it; black paper has none); kept where above Otsu's threshold on ink, as a
   stroke of 1 (LeCun et al. fitted NIST's binary images, the anti-aliasing making the grey levels); specks (parts
   under `PART` of the largest part) dropped.
4. Cropped to the ink's bounding box, resized (antialiased) to fit a box of 20/28 of the side, keeping its aspect.
5. Pasted so its centre of mass falls on the centre pixel (14, 14) of 28×28, as MNIST's digits' do.

An image whose kept ink is on median less than `MIN_CONTRAST` darker than the paper is blank paper: all zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np

WORK_SIDE = 512  # larger images are first reduced (area average) to this longer side
BACKGROUND_SIDE = 64  # the paper is estimated on a copy of this longer side
CLOSING = 0.25  # the closing's window, as a fraction of the background copy's shorter side (wider than strokes)
MIN_CONTRAST = 0.2  # kept "ink" of median darkness under this, relative to the paper, is noise: no ink
BOX = 20 / 28  # the box the ink is fitted in, as a fraction of the side (MNIST: 20 of 28)
PARTS_SIDE = 128  # the ink's parts are found on its mask pooled to at most this side
PART = 0.1  # ink parts of fewer pixels than this fraction of the largest part's are specks
IN_WORDS = "MNIST's procedure (paper and light removed, ink cropped, fitted in a 20/28 box, centred by its mass)"


def mnist_form(image: Any, *, size: int = 28) -> np.ndarray:
    """`image` (a Pillow image, or an array H×W grey or H×W×3 RGB of uint8 in 0..255 or floats in [0, 1]) in
    MNIST's form: float32 [size, size] in [0, 1], white ink on black, fitted in a 20/28 box and centred by its
    centre of mass."""
    from PIL import Image

    g = _grey(image)
    if not _light_background(g):
        g = Image.fromarray(255 - np.asarray(g))  # white ink on black: make the paper light
    x, paper = np.asarray(g, np.float64) / 255, _paper(g)
    ink = np.clip((paper - x) / np.maximum(paper, 1e-3), 0, 1)  # darkness relative to the paper  [H, W]
    mask = ink > max(otsu(ink), MIN_CONTRAST / 2)
    if not mask.any() or np.median(ink[mask]) < MIN_CONTRAST:  # blank paper: what passes is noise
        return np.zeros((size, size), np.float32)
    mask = _main_parts(mask)
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    digit = _fit(mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1], max(1, round(size * BOX)))
    return _centre(digit, size)


def _grey(image: Any):
    """`image` as a Pillow image of mode L (ITU-R 601 luma), reduced (area average) to at most WORK_SIDE."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        x = np.asarray(image)
        if x.dtype != np.uint8:
            x = np.round(np.clip(x.astype(np.float64), 0, 1) * 255).astype(np.uint8)
        if not (x.ndim == 2 or (x.ndim == 3 and x.shape[-1] in (1, 3, 4))) or min(x.shape[:2]) < 1:
            raise ValueError(f"an image is H×W or H×W×3, not {x.shape}")
        image = Image.fromarray(x[..., 0] if x.ndim == 3 and x.shape[-1] == 1 else x)
    return _reduce(image.convert("L"), WORK_SIDE)


def _reduce(img, side: int):
    """Pillow image `img` reduced (area average) so that its longer side is at most `side`."""
    from PIL import Image

    w, h = img.size
    scale = side / max(w, h)
    return img if scale >= 1 else img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BOX)


def _light_background(g) -> bool:
    """Whether the ink is darker than the paper, in Pillow L image `g`: on a copy of at most BACKGROUND_SIDE pixels,
    the pixels' deviations from the median around them (the paper: the ink is the minority there; a shadow's edge
    stays) weigh more below it than above (sums of squares)."""
    from PIL import ImageFilter

    small = _reduce(g, BACKGROUND_SIDE)
    k = max(3, int(CLOSING * min(small.size)) | 1)
    dev = np.asarray(small, np.float64) - np.asarray(small.filter(ImageFilter.MedianFilter(k)), np.float64)
    return bool((np.clip(-dev, 0, None) ** 2).sum() >= (np.clip(dev, 0, None) ** 2).sum())


def _paper(g) -> np.ndarray:
    """The paper's grey level in [0, 1] under uneven light [H, W] of Pillow L image `g`: a closing wider than the
    strokes between box blurs (noise would bias the max filter up), on a copy of at most BACKGROUND_SIDE pixels,
    resized back (bilinear)."""
    from PIL import Image, ImageFilter

    small = _reduce(g, BACKGROUND_SIDE)
    k = max(3, int(CLOSING * min(small.size)) | 1)  # odd
    for f in (ImageFilter.BoxBlur(1), ImageFilter.MaxFilter(k), ImageFilter.MinFilter(k), ImageFilter.BoxBlur(1)):
        small = small.filter(f)
    return np.asarray(small.resize(g.size, Image.Resampling.BILINEAR), np.float64) / 255


def _main_parts(mask: np.ndarray) -> np.ndarray:
    """The ink mask [H, W] without its specks: the 8-connected parts of at least PART × the largest's pixels (a
    digit may be drawn in more than one stroke; dust, noise and a shadow's corner make small parts). The parts are
    found on the mask pooled (any) to at most PARTS_SIDE pixels a side, in blocks of f × f."""
    h, w = mask.shape
    f = -(-max(h, w) // PARTS_SIDE)  # ceil
    padded = np.pad(mask, ((0, -h % f), (0, -w % f)))
    blocks = np.asarray(padded.reshape(-(-h // f), f, -(-w // f), f).any(axis=(1, 3)))  # [⌈h/f⌉, ⌈w/f⌉]
    labels = _components(blocks).repeat(f, axis=0).repeat(f, axis=1)[:h, :w]  # each pixel: its block's part
    sizes = np.bincount(labels[mask])
    return mask & (sizes >= PART * sizes.max())[labels]


def _components(mask: np.ndarray) -> np.ndarray:
    """Labels [H, W] of the 8-connected parts of `mask` (each part: the smallest flat index in it; outside: 0).
    Min-label propagation over the 3×3 neighbours, with pointer jumping, until nothing changes."""
    h, w = mask.shape
    none = h * w  # the label of the background: larger than any pixel's
    labels = np.where(mask, np.arange(none).reshape(h, w), none)
    while True:
        padded = np.pad(labels, 1, constant_values=none)
        low = labels
        for dy in range(3):
            for dx in range(3):
                low = np.minimum(low, padded[dy : dy + h, dx : dx + w])
        flat = np.append(np.where(mask, low, none).ravel(), none)
        for _ in range(4):  # pointer jumping: a label's own label is as small or smaller, in the same part
            flat = flat[flat]
        new = flat[:-1].reshape(h, w)
        if np.array_equal(new, labels):
            return np.where(mask, labels, 0)
        labels = new


def otsu(x: np.ndarray, bins: int = 256) -> float:
    """Otsu's threshold of values in [0, 1]: the bin edge maximising the between-class variance."""
    counts, edges = np.histogram(x, bins=bins, range=(0.0, 1.0))
    p = counts / counts.sum()
    w0, m0 = np.cumsum(p), np.cumsum(p * (edges[:-1] + edges[1:]) / 2)
    between = (m0[-1] * w0 - m0) ** 2 / np.maximum(w0 * (1 - w0), 1e-12)
    return float(edges[int(np.argmax(between[:-1])) + 1])


def _fit(mask: np.ndarray, inner: int) -> np.ndarray:
    """The ink mask [h, w] resized (Lanczos, antialiased) so its longer side is `inner`, aspect kept: grey levels
    in [0, 1]."""
    from PIL import Image

    h, w = mask.shape
    scale = inner / max(h, w)
    img = Image.fromarray(mask.astype(np.float32))  # mode F
    img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)
    return np.clip(np.asarray(img, np.float64), 0, 1)


def _centre(digit: np.ndarray, size: int) -> np.ndarray:
    """`digit` [h, w] pasted into size×size so that its centre of mass is on pixel (size/2, size/2), rounded, the
    digit kept inside."""
    h, w = digit.shape
    ys, xs = np.indices(digit.shape)
    mass = digit.sum()
    cy, cx = ((ys * digit).sum() / mass, (xs * digit).sum() / mass) if mass > 0 else ((h - 1) / 2, (w - 1) / 2)
    top = min(max(round(size / 2 - cy), 0), size - h)
    left = min(max(round(size / 2 - cx), 0), size - w)
    out = np.zeros((size, size), np.float32)
    out[top : top + h, left : left + w] = digit
    return out
