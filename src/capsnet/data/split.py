"""In-memory data: a split of uint8 images and int64 labels, a data set of train, test (and official validation)
splits, and the stratified hold-out that carves a validation split out of a training split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import DatasetError


@dataclass(frozen=True)
class Split:
    """One split in memory: uint8 images [N, C, H, W] and int64 labels [N]; `channel_stats`, per-channel pixel mean
    and std, when the reader measured them on the originals before resizing (capsnet.data.scaling)."""

    images: torch.Tensor
    labels: torch.Tensor
    channel_stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def take(self, index: torch.Tensor) -> Split:
        """The examples at `index` (a 1-D int64 tensor), in that order; `channel_stats` stay those of the split they
        were taken from (a validation split is standardized as the training split it was held out of)."""
        return Split(self.images[index], self.labels[index], self.channel_stats)


def holdout_counts(class_counts: np.ndarray, fraction: float) -> np.ndarray:
    """How many examples of each class a stratified hold-out of `fraction` takes: round(fraction · N) in all (at
    least 1), shared out over the classes in proportion to their counts by largest remainder, never a whole class.
    """
    total = int(class_counts.sum())
    want = min(max(1, round(fraction * total)), total - 1)
    exact = class_counts * (want / total)
    counts = np.minimum(np.floor(exact).astype(np.int64), np.maximum(class_counts - 1, 0))
    for k in np.argsort(-(exact - counts), kind="stable"):  # the largest remainders first
        if counts.sum() >= want:
            break
        if counts[k] < class_counts[k] - 1:
            counts[k] += 1
    return counts


def stratified_holdout(split: Split, fraction: float, *, seed: int) -> tuple[Split, Split]:
    """(kept, held out): a seeded, stratified `fraction` of `split` held out (e.g. a validation split of a
    training split). Each class gives its share (`holdout_counts`); both parts keep the original order.
    The draw depends on (seed, labels) alone, so the same split comes back on every run and rank."""
    kept_idx, held_idx = holdout_indices(split.labels, fraction, seed=seed)
    return split.take(kept_idx), split.take(held_idx)


def holdout_indices(labels: torch.Tensor, fraction: float, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, held out) indices [int64] of `stratified_holdout` for class indices `labels` [N], each part
    in the original order."""
    if not 0 < fraction < 1:
        raise DatasetError(f"a held-out fraction must be in (0, 1), got {fraction}")
    labels_np = labels.cpu().numpy()
    if len(labels_np) < 2:
        raise DatasetError(f"cannot hold out {fraction:g} of {len(labels_np)} example(s)")
    if labels_np.min() < 0:
        raise DatasetError(f"labels must be class indices >= 0, got {int(labels_np.min())}")
    n_classes = int(labels_np.max()) + 1
    counts = holdout_counts(np.bincount(labels_np, minlength=n_classes), fraction)
    rng = np.random.default_rng(seed)
    held = np.zeros(len(labels_np), dtype=bool)
    for k in range(n_classes):
        members = np.flatnonzero(labels_np == k)
        held[rng.permutation(members)[: counts[k]]] = True
    kept_idx, held_idx = (torch.from_numpy(np.flatnonzero(m)) for m in (~held, held))
    return kept_idx, held_idx


@dataclass(frozen=True)
class Dataset:
    name: str
    source: str  # the folder the files came from, or "bundled"
    train: Split | None  # None for a test-only folder
    test: Split
    n_classes: int = 10
    class_names: tuple[str, ...] = ()  # one per class when the source names them (folders, CIFAR meta files)
    digits: bool = False  # MNIST-style ink images: `predict` inverts light backgrounds and fits a 20/28 box
    kind: str = ""  # the reader's format (capsnet.data.sources.FORMATS), which picks the default augmentation
    val: Split | None = None  # an official validation split (image folders with train/, val/ and test/)

    @property
    def names(self) -> tuple[str, ...]:
        """The class names, or "0", "1", ... when the source gives none."""
        return self.class_names or tuple(str(k) for k in range(self.n_classes))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images."""
        return tuple(self.test.images.shape[1:])  # type: ignore[return-value]
