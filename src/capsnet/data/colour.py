"""Whether an RGB training split's colours tell its classes apart: the check by which `--augment auto` adds colour
augmentation to a folder or .npz of one's own (docs/training.md, "What learns a folder of one's own")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .split import Split

MIN_IMAGES = 20  # fewer training images than this: too few to tell, and the check does not run
SIGMAS = 3.0  # colour "tells the classes apart" when the classifier beats chance by more than 3 standard errors


@dataclass(frozen=True)
class ColourCheck:
    """A nearest-centroid classifier on each image's mean colour, fitted on one half of each class of the training
    split and scored on the other, both ways round. `accuracy`: its held-out accuracy; `chance`: the largest
    class's share; `margin`: SIGMAS standard errors of a chance classifier's accuracy on `n` images."""

    accuracy: float
    chance: float
    margin: float
    n: int

    @property
    def colour_free(self) -> bool:
        """Whether the colours tell the classes apart no better than chance does (within the margin)."""
        return self.accuracy <= self.chance + self.margin

    def line(self) -> str:
        """One line saying what the check found."""
        verdict = "do not tell" if self.colour_free else "tell"
        return (
            f"the training images' mean colours {verdict} their classes apart (a nearest-centroid classifier on them: "
            f"{100 * self.accuracy:.1f}% held out, chance {100 * self.chance:.1f}%)"
        )


def colour_check(train: Split) -> ColourCheck | None:
    """The check on a training split of RGB images; None for other channel counts, one class, or too few images."""
    images, labels = train.images, train.labels
    n = len(labels)
    if images.shape[1] != 3 or n < MIN_IMAGES:
        return None
    k = int(labels.max()) + 1
    counts = torch.bincount(labels, minlength=k)
    if int((counts > 0).sum()) < 2:
        return None
    # each image's mean colour  [N, 3] (a chunk at a time: a large folder's images as floats need not fit in memory)
    colours = torch.cat([chunk.float().mean(dim=(2, 3)) for chunk in images.split(1024)])
    order = torch.argsort(labels, stable=True)
    rank = torch.empty(n, dtype=torch.long)  # each image's place among its class's images
    rank[order] = torch.arange(n) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    right = 0
    for half in (0, 1):  # fit on each class's even (odd) images, score the odd (even) ones
        fit = rank % 2 == half
        present = torch.bincount(labels[fit], minlength=k) > 0
        sums = torch.zeros(k, 3).index_add_(0, labels[fit], colours[fit])
        centroids = sums / torch.bincount(labels[fit], minlength=k).clamp(min=1)[:, None]  # [K, 3]
        distance = torch.cdist(colours[~fit], centroids).masked_fill(~present, float("inf"))  # [N/2, K]
        right += int((distance.argmin(dim=1) == labels[~fit]).sum())
    chance = float(counts.max()) / n
    return ColourCheck(right / n, chance, SIGMAS * (chance * (1 - chance) / n) ** 0.5, n)
