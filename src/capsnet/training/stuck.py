"""Whether training is stuck (at chance, lengths saturated), and the one line that says what to try.

Capsule networks trap themselves in a way a CNN does not: when every class capsule's length is pushed into the
squash's flat ends (all near 1, or all near 0), the margin loss's gradient through |v| vanishes (d|v|/d|s| falls
as |s|^-3 at the long end) and Adam, whose second moment still holds the earlier, larger gradients, takes steps
too small to leave. Accuracy then sits at chance for the rest of the run (docs/training.md, "When training is
stuck").
"""

from __future__ import annotations

from dataclasses import dataclass

# "At chance": training accuracy within a tenth of the way from chance to perfect.
CHANCE_MARGIN = 0.1
# "Saturated": the mean shortest class-capsule length at least this (all near 1), or the mean longest at most
# 1 - this (all near 0).
SATURATED = 0.9


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


__all__ = ["CHANCE_MARGIN", "SATURATED", "LengthStats", "at_chance", "saturation", "stuck_line"]
