"""The stuck-training line (capsnet.training.stuck): said only at chance with every class capsule saturated."""

from __future__ import annotations

import pytest

from capsnet.training.stuck import LengthStats, at_chance, saturation, stuck_line


@pytest.mark.parametrize(
    ("accuracy", "n_classes", "expected"),
    [(0.3333, 3, True), (0.40, 3, True), (0.41, 3, False), (0.55, 2, True), (0.56, 2, False), (0.19, 10, True),
     (0.20, 10, False), (0.98, 10, False)],
)  # fmt: skip
def test_at_chance_is_within_a_tenth_of_the_way_to_perfect(accuracy, n_classes, expected):
    assert at_chance(accuracy, n_classes) is expected


def test_saturation_names_the_end_every_length_sits_at():
    assert saturation(LengthStats(shortest=0.95, longest=0.99)) == "near 1"
    assert saturation(LengthStats(shortest=0.01, longest=0.08)) == "near 0"
    assert saturation(LengthStats(shortest=0.05, longest=0.95)) is None  # a working model: one long, the rest short
    assert saturation(LengthStats(shortest=0.5, longest=0.6)) is None


def test_the_line_names_the_epoch_the_accuracy_the_lengths_and_what_to_try():
    line = stuck_line(epoch=3, accuracy=1 / 3, n_classes=3, stats=LengthStats(0.991, 0.997), hint="--lr 1e-4")
    assert line is not None and "\n" not in line
    assert "after epoch 3" in line and "33.3%" in line and "3 classes" in line
    assert "near 1" in line and "0.991" in line and line.endswith("try --lr 1e-4")


def test_no_line_when_learning_or_when_unsaturated_or_unmeasured():
    saturated = LengthStats(0.99, 0.99)
    assert stuck_line(epoch=1, accuracy=0.9, n_classes=3, stats=saturated, hint="x") is None
    assert stuck_line(epoch=1, accuracy=0.33, n_classes=3, stats=LengthStats(0.1, 0.6), hint="x") is None
    assert stuck_line(epoch=1, accuracy=0.33, n_classes=3, stats=None, hint="x") is None
