"""Which weights become best/: the monitored validation quantity, compared after each epoch, and the choice.

The monitor (Lightning's `monitor`) is compared after each epoch. A monitor is `val_loss` (lowest wins),
`val_accuracy` (highest wins) or a comma list of them compared in order, each next one breaking the ties of the one
before: `val_accuracy,val_loss` is the highest accuracy, and among epochs of equal accuracy the lowest loss. An
exact tie on every quantity keeps the earlier checkpoint (and at the same epoch the raw weights before their moving
average).

The split scored is the validation split; without one, the test split stands in (best/ is then a maximum over
epochs on the test set, as test.json says); with neither, best/ is the epoch of the lowest training loss.

The weights' moving average (`--ema`, capsnet.training.ema) is a candidate beside the raw weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

QUANTITIES = {"val_accuracy": "accuracy", "val_loss": "loss"}  # a monitor's name -> the evaluation's key
HIGHER_IS_BETTER = {"accuracy": True, "loss": False}
DEFAULT_MONITOR = "val_loss"  # chosen by the screens of docs/results.md ("Choosing best/")
SELECTED_ON = {
    "val_acc": "validation accuracy",
    "val_loss": "validation loss",
    "test_acc": "test accuracy",
    "test_loss": "test loss",
    "train_loss": "the training loss",
}  # a best/'s metric, in words


@dataclass(frozen=True)
class Monitor:
    """The quantities compared, in order: evaluation keys ("accuracy", "loss")."""

    keys: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Monitor:
        names = [name.strip() for name in str(spec).split(",")]
        if not names or any(n not in QUANTITIES for n in names) or len(set(names)) != len(names):
            raise ConfigError(
                f"monitor must be {', '.join(QUANTITIES)} or a comma list of them (each next one "
                f"breaks the ties of the one before), got {spec!r}"
            )
        return cls(tuple(QUANTITIES[n] for n in names))

    def rank(self, scores: dict[str, float]) -> tuple[float, ...]:
        """Larger is better, element by element; a missing or NaN quantity ranks below every number."""
        out = []
        for key in self.keys:
            value = scores.get(key, math.nan)
            value = value if HIGHER_IS_BETTER[key] else -value
            out.append(-math.inf if math.isnan(value) else value)
        return tuple(out)

    def better(self, scores: dict[str, float], best: dict[str, float] | None) -> bool:
        """Whether `scores` beat `best` (None: nothing chosen yet). Ties keep `best`."""
        return best is None or self.rank(scores) > self.rank(best)

    def metric(self, split: str) -> str:
        """The history column of the first quantity on `split` ("val_loss", "test_acc", ...)."""
        return f"{split}_{'acc' if self.keys[0] == 'accuracy' else 'loss'}"


def best_scores(best: dict[str, Any]) -> dict[str, float] | None:
    """The scores a recorded best/ was chosen with; a state.pt made before monitors records only its metric's
    value (an accuracy, or the training loss)."""
    if not best or best.get("value") is None:
        return None
    if isinstance(best.get("scores"), dict):
        return dict(best["scores"])
    key = "accuracy" if str(best.get("metric", "")).endswith("_acc") else "loss"
    return {key: float(best["value"])}


def choose_best(
    best: dict[str, Any],
    candidates: list[tuple[str, dict[str, float]]],
    *,
    spec: str,
    split: str | None,
    epoch: int,
    step: int,
) -> dict[str, Any]:
    """best/'s record after an epoch: each of `candidates` ((weights "raw" | "ema", scores), the raw weights first,
    so an exact tie keeps them) that beats the record by the monitor `spec` on `split` replaces it; `split` None
    (no held-out data) compares the training loss."""
    monitor = Monitor.parse(spec)
    for weights, scores in candidates:
        if monitor.better(scores, best_scores(best)):
            metric = monitor.metric(split) if split is not None else "train_loss"
            best = {
                "epoch": epoch,
                "step": step,
                "metric": metric,
                "value": scores[monitor.keys[0]],
                "monitor": spec,
                "scores": scores,
                "weights": weights,
            }
    return best


def check_decay(decay: float | None) -> None:
    """ConfigError unless `decay` (an EMA's, `--ema`) is None or in (0, 1)."""
    if decay is not None and not 0 < decay < 1:
        raise ConfigError(f"ema must be a decay in (0, 1), e.g. 0.999, got {decay}")
