"""Small synthetic image sets that any model should learn in a few epochs: the trainability suite's cases.

Each case is easy for a person and for a small CNN, and each one stresses what one's own data differs in from
MNIST: colour and a background that is not black, another size, few or many classes, few images.

    shapes      3 classes (circle, square, triangle), 32×32 RGB: random colours (of a plain contrast), sizes and
                positions
    two-shapes  2 classes (circle, square), otherwise as shapes
    shapes-20   20 classes: 5 shapes × 4 hues, 32×32 RGB on a random grey
    color-digits  10 classes: the bundled MNIST digits, 28×28 RGB, ink and paper in random colours
    textures    4 classes (horizontal stripes, vertical stripes, checks, dots), 64×64 RGB, random colours, period
                and phase

`make_case(name, n_per_class=..., seed=...)` gives a `Dataset` in memory; `write_folder` writes it as class
folders of PNG files, which `capsnet train --dataset FOLDER` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DatasetError
from ..fileio import staging_folder
from .split import Dataset, Split

SHAPES = ("circle", "square", "triangle", "diamond", "cross")
HUES = ((220, 40, 40), (40, 180, 40), (40, 80, 230), (230, 200, 30))  # red, green, blue, yellow
TEXTURES = ("horizontal", "vertical", "checks", "dots")


def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.mgrid[0:size, 0:size]
    return ys + 0.5, xs + 0.5  # pixel centres


def shape_mask(shape: str, size: int, cx: float, cy: float, r: float) -> np.ndarray:
    """bool [size, size]: `shape` of half-width `r` centred at (cx, cy)."""
    ys, xs = _grid(size)
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if shape == "triangle":  # apex up: inside the base line and both sloped sides
        return (dy <= r) & (2 * np.abs(dx) <= (dy + r))
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= r
    if shape == "cross":
        arm = r / 3
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))
    raise ValueError(f"unknown shape {shape!r}")


LUMA = np.array([0.299, 0.587, 0.114])  # Rec. 601 luma weights of R, G, B
MIN_CONTRAST = 64  # the least luma difference between a shape and its background: a quarter of the range


def _distinct_colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(background, foreground): random RGB colours whose luma differs by at least MIN_CONTRAST, so that the shape
    is plain to see (random hues of equal brightness are not: a person, and every model, finds those hard)."""
    while True:
        bg, fg = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        if abs(float(LUMA @ (bg - fg))) >= MIN_CONTRAST:
            return bg, fg


def _paint(mask: np.ndarray, bg: np.ndarray, fg: np.ndarray) -> np.ndarray:
    """uint8 [3, H, W]: `fg` where `mask`, `bg` elsewhere."""
    return np.where(mask[None], fg[:, None, None], bg[:, None, None]).astype(np.uint8)


def _shapes(names: tuple[str, ...], size: int = 32) -> Callable[[int, np.random.Generator], np.ndarray]:
    def draw(k: int, rng: np.random.Generator) -> np.ndarray:
        r = rng.uniform(5, 12) * size / 32
        cx, cy = rng.uniform(r + 1, size - r - 1, 2)
        return _paint(shape_mask(names[k], size, cx, cy, r), *_distinct_colours(rng))

    return draw


def _shapes_20(k: int, rng: np.random.Generator, size: int = 32) -> np.ndarray:
    shape, hue = SHAPES[k // len(HUES)], np.array(HUES[k % len(HUES)])
    r = rng.uniform(7, 12)
    cx, cy = rng.uniform(r + 1, size - r - 1, 2)
    grey = np.full(3, rng.integers(90, 170))
    return _paint(shape_mask(shape, size, cx, cy, r), grey, hue + rng.integers(-25, 26, 3)).clip(0, 255)


def _texture(k: int, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    ys, xs = _grid(size)
    period = rng.uniform(6, 12)
    py, px = rng.uniform(0, period, 2)
    sy, sx = np.sin(2 * np.pi * (ys + py) / period), np.sin(2 * np.pi * (xs + px) / period)
    mask = {"horizontal": sy > 0, "vertical": sx > 0, "checks": sy * sx > 0, "dots": (sy > 0.5) & (sx > 0.5)}
    return _paint(mask[TEXTURES[k]], *_distinct_colours(rng))


@dataclass(frozen=True)
class Case:
    """One trainability case: its classes and how one image of class k is drawn."""

    classes: tuple[str, ...]
    draw: Callable[[int, np.random.Generator], np.ndarray] | None  # None: color-digits (drawn from MNIST digits)
    size: int
    n_train: int  # training images per class in the suite (a tenth of them held out for validation)
    n_test: int  # test images per class in the suite


# Each case as the suite trains it (benchmarks/trainability.py, tests/test_trainability.py): a user's small folder.
CASES: dict[str, Case] = {
    "shapes": Case(SHAPES[:3], _shapes(SHAPES[:3]), 32, n_train=100, n_test=100),
    "two-shapes": Case(SHAPES[:2], _shapes(SHAPES[:2]), 32, n_train=100, n_test=100),
    "shapes-20": Case(
        tuple(f"{s}-{h}" for s in SHAPES for h in ("red", "green", "blue", "yellow")),
        _shapes_20,
        32,
        n_train=30,
        n_test=30,
    ),
    "color-digits": Case(tuple(str(d) for d in range(10)), None, 28, n_train=60, n_test=50),
    "textures": Case(TEXTURES, _texture, 64, n_train=60, n_test=50),
}
SUITE_EPOCHS = 10  # the suite's budget: a user's first `capsnet train` on a small folder


def _color_digits(n_per_class: int, rng: np.random.Generator, part: str) -> tuple[np.ndarray, np.ndarray]:
    """The first n_per_class bundled digits of each class (of the training or test split), in random colours."""
    from .datasets import load_dataset  # (the bundled sample: no network)

    source = load_dataset()
    split = source.train if part == "train" else source.test
    assert split is not None
    labels = split.labels.numpy()
    index = np.concatenate([np.flatnonzero(labels == k)[:n_per_class] for k in range(10)])
    ink = split.images.numpy()[index, 0].astype(np.float32) / 255  # [N, 28, 28], 1 = ink
    images = np.empty((len(index), 3, 28, 28), dtype=np.uint8)
    for i, alpha in enumerate(ink):
        bg, fg = _distinct_colours(rng)
        images[i] = (bg[:, None, None] * (1 - alpha) + fg[:, None, None] * alpha).round().astype(np.uint8)
    return images, labels[index]


def _split(case: Case, name: str, n_per_class: int, seed: int, part: str) -> Split:
    rng = np.random.default_rng([seed, 0 if part == "train" else 1])
    if case.draw is None:
        images, labels = _color_digits(n_per_class, rng, part)
    else:
        labels = np.repeat(np.arange(len(case.classes)), n_per_class)
        images = np.stack([case.draw(int(k), rng) for k in labels])
    order = rng.permutation(len(labels))
    return Split(torch.from_numpy(images[order]), torch.from_numpy(labels[order].astype(np.int64)))


def make_case(name: str, *, n_per_class: int = 100, n_test_per_class: int = 50, seed: int = 0) -> Dataset:
    """The case `name` (CASES) in memory: `n_per_class` training and `n_test_per_class` test images per class."""
    if name not in CASES:
        raise DatasetError(f"unknown trainability case {name!r}; known: {', '.join(CASES)}")
    case = CASES[name]
    train = _split(case, name, n_per_class, seed, "train")
    test = _split(case, name, n_test_per_class, seed, "test")
    classes = case.classes
    return Dataset(name, "synthetic", train, test, n_classes=len(classes), class_names=classes, kind="folder")


def write_folder(data: Dataset, root: str | Path) -> Path:
    """`data` as ROOT/train/CLASS/*.png and ROOT/test/CLASS/*.png (Pillow: the `images` extra)."""
    from .folder import pillow

    image_module = pillow()
    root = Path(root)
    for part, split in (("train", data.train), ("test", data.test)):
        assert split is not None
        for i, (image, label) in enumerate(zip(split.images.numpy(), split.labels.tolist())):
            folder = root / part / data.names[label]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = image.transpose(1, 2, 0) if image.shape[0] == 3 else image[0]
            image_module.fromarray(pixels).save(folder / f"{i:05d}.png")
    return root


def write_case(name: str, root: str | Path, *, seed: int = 0) -> Path:
    """The case `name` at the suite's sizes as class folders under `root` (written once: kept when present).

    Written into a temporary sibling folder and renamed into place, so that runs started side by side on one `root`
    each read the whole case: the first rename wins, the others' copies (the same images) are dropped."""
    root = Path(root)
    if (root / "test").is_dir():
        return root
    case = CASES.get(name)
    if case is None:
        raise DatasetError(f"unknown trainability case {name!r}; known: {', '.join(CASES)}")
    with staging_folder(root) as partial:
        write_folder(make_case(name, n_per_class=case.n_train, n_test_per_class=case.n_test, seed=seed), partial)
        try:
            partial.rename(root)  # (onto a missing or empty folder)
        except OSError:
            if not (root / "test").is_dir():
                raise DatasetError(f"{root} exists and does not hold the case {name!r}: give an empty folder") from None
    return root


__all__ = ["CASES", "SUITE_EPOCHS", "Case", "make_case", "shape_mask", "write_case", "write_folder"]
