"""Whether training is stuck or memorising, and the one line that says what to try.

Stuck: accuracy at chance with every class capsule's length saturated. Memorising: the training images fitted and
the held-out ones not.

Capsule networks trap themselves in a way a CNN does not: when every class capsule's length is pushed into the
squash's flat ends (all near 1, or all near 0), the margin loss's gradient through |v| vanishes (d|v|/d|s| falls
as |s|^-3 at the long end) and Adam, whose second moment still holds the earlier, larger gradients, takes steps
too small to leave. Accuracy then sits at chance for the rest of the run (docs/training.md, "When training is
stuck").

A model can also learn what tells its training images apart rather than what makes their classes: on a few hundred
images of shapes in random colours, the colours (docs/training.md, "What learns a folder of one's own"). Training
accuracy then reaches 100% while the held-out accuracy stays far below it, and the line says so once a run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import CheckpointError

# "At chance": training accuracy within a tenth of the way from chance to perfect.
CHANCE_MARGIN = 0.1
# "Saturated": the mean shortest class-capsule length at least this (all near 1), or the mean longest at most
# 1 - this (all near 0).
SATURATED = 0.9
# "Memorising": training accuracy at least FITTED, and the held-out (validation) accuracy at least GAP below it.
FITTED = 0.95
GAP = 0.25


@dataclass(frozen=True)
class LengthStats:
    """Class-probability statistics of an evaluation pass: the mean over images of the shortest and the longest
    class capsule's length (or activation)."""

    shortest: float
    longest: float


def at_chance(accuracy: float, n_classes: int) -> bool:
    chance = 1.0 / n_classes
    return accuracy <= chance + CHANCE_MARGIN * (1.0 - chance)


def saturation(stats: LengthStats) -> str | None:
    """'near 1' or 'near 0' when every class capsule's length sits at one end of the squash, else None."""
    if stats.shortest >= SATURATED:
        return "near 1"
    if stats.longest <= 1.0 - SATURATED:
        return "near 0"
    return None


def stuck_line(*, epoch: int, accuracy: float, n_classes: int, stats: LengthStats | None, hint: str) -> str | None:
    """One line for an epoch whose training `accuracy` is at chance while every class capsule's length is saturated
    (None otherwise, or without length statistics). `hint` says what to try, in the caller's terms (flags for
    `capsnet train`, arguments for `capsnet.fit`)."""
    if stats is None or not at_chance(accuracy, n_classes):
        return None
    end = saturation(stats)
    if end is None:
        return None
    return (
        f"capsnet: training looks stuck after epoch {epoch}: accuracy {100 * accuracy:.1f}% is chance for "
        f"{n_classes} classes and every class capsule's length is {end} (mean shortest {stats.shortest:.3f}, "
        f"longest {stats.longest:.3f}), where the squash passes no gradient; try {hint}"
    )


def epoch_stuck_line(row: Mapping[str, float], *, n_classes: int, flag: str) -> str | None:
    """`stuck_line` for an epoch's row of the run's history (summary.csv): its training accuracy and the
    class lengths its evaluation measured (None when it measured none). `flag` is how the user sets the learning
    rate: "--lr" (capsnet train) or "lr=" (capsnet.fit)."""
    shortest, longest = row.get("shortest_length"), row.get("longest_length")
    if n_classes < 2 or shortest is None or longest is None or math.isnan(shortest) or math.isnan(longest):
        return None
    lr = row.get("lr", math.nan)
    lower = f"{flag}{' ' if flag.startswith('--') else ''}{lr / 10:.0e}" if lr > 0 else f"a lower {flag}"
    hint = f'a learning rate 3-10x lower ({lower}; docs/training.md, "When training is stuck")'

    return stuck_line(
        epoch=int(row["epoch"]),
        accuracy=row["train_acc"],
        n_classes=n_classes,
        stats=LengthStats(shortest, longest),
        hint=hint,
    )


def memorising(row: Mapping[str, float]) -> bool:
    """Whether an epoch's row (summary.csv) fitted its training images and not the validation split (`FITTED`,
    `GAP`); False without a validation split."""
    train, val = row.get("train_acc"), row.get("val_acc")
    if train is None or val is None or math.isnan(train) or math.isnan(val):
        return False
    return train >= FITTED and train - val >= GAP


def memorising_line(row: Mapping[str, float], earlier: Sequence[Mapping[str, float]], *, flag: str) -> str | None:
    """One line at the first epoch of a run (`earlier`: the rows before it) that is `memorising`; None otherwise.
    `flag` is "--lr" (capsnet train: the hint names `--augment`) or "lr=" (capsnet.fit: the Dataset's own)."""
    if not memorising(row) or any(memorising(r) for r in earlier):
        return None
    if flag.startswith("--"):
        vary = "--augment shift=2,colour where colour does not make the class, flip, rotate=DEG"
    else:
        vary = "random transforms in the Dataset's __getitem__"
    return (
        f"capsnet: after epoch {int(row['epoch'])} the model fits its training images ({100 * row['train_acc']:.1f}%) "
        f"far better than the held-out ones ({100 * row['val_acc']:.1f}%): it tells the training images apart by "
        f"something other than their classes; try more images per class, or an augmentation that varies what does "
        f'not make a class ({vary}; docs/training.md, "What learns a folder of one\'s own")'
    )


def run_stuck_line(run_dir: str | os.PathLike, *, n_classes: int) -> str | None:
    """The stuck line of a run folder's last epoch (summary.csv), for `capsnet explore`'s note; None when the
    run is not stuck or records no class lengths."""
    from .checkpoint import read_summary

    try:
        rows = read_summary(run_dir)
    except (CheckpointError, OSError):
        return None
    return epoch_stuck_line(rows[-1], n_classes=n_classes, flag="--lr") if rows else None


__all__ = [
    "CHANCE_MARGIN",
    "FITTED",
    "GAP",
    "SATURATED",
    "LengthStats",
    "at_chance",
    "epoch_stuck_line",
    "memorising",
    "memorising_line",
    "run_stuck_line",
    "saturation",
    "stuck_line",
]
