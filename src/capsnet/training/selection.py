"""Which weights become best/: the monitored validation quantity, the weights' moving average, the choice.

The monitor (Lightning's `monitor`) is compared after each epoch. A monitor is `val_loss` (lowest wins),
`val_accuracy` (highest wins) or a comma list of them compared in order, each next one breaking the ties of the one
before: `val_accuracy,val_loss` is the highest accuracy, and among epochs of equal accuracy the lowest loss. An
exact tie on every quantity keeps the earlier checkpoint (and at the same epoch the raw weights before their moving
average).

The split scored is the validation split; without one, the test split stands in (best/ is then a maximum over
epochs on the test set, as test.json says); with neither, best/ is the epoch of the lowest training loss.

The weights' exponential moving average (`--ema DECAY`) is scored on validation beside the raw weights.

After every optimizer step t (1, 2, ...), each floating-point parameter θ is averaged into its shadow θ̄:

    d_t = min(DECAY, (1 + t) / (10 + t))          # the warm-up of TensorFlow's ExponentialMovingAverage
    θ̄ ← d_t · θ̄ + (1 − d_t) · θ                   # every parameter, any shape, in place

so early shadows follow the weights closely instead of remembering the initialisation for ~1 / (1 − DECAY) steps.
Buffers (batch-norm running statistics and counters, routing priors held as buffers) are not averaged: they are
copied from the trained model at every update, so the shadow's statistics are the raw model's latest.

The shadow is a full copy of the model (`average.model`), kept in eval mode, on the model's device. Its state
(weights, buffers and the step count) goes into state.pt as tensors and numbers only (weights_only loadable); a
resumed run restores it exactly. Every torchrun rank averages the same synchronized weights, so the ranks agree.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

QUANTITIES = {"val_accuracy": "accuracy", "val_loss": "loss"}  # a monitor's name -> the evaluation's key
HIGHER_IS_BETTER = {"accuracy": True, "loss": False}
DEFAULT_MONITOR = "val_loss"  # chosen by the screens of docs/results.md ("Choosing best/")
LEGACY_MONITOR = "val_accuracy"  # what a run recorded before `monitor` existed chose best/ on
SELECTED_ON = {"val_acc": "validation accuracy", "val_loss": "validation loss", "test_acc": "test accuracy",
               "test_loss": "test loss", "train_loss": "the training loss"}  # a best/'s metric, in words  # fmt: skip


@dataclass(frozen=True)
class Monitor:
    """The quantities compared, in order: evaluation keys ("accuracy", "loss")."""

    keys: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Monitor:
        names = [name.strip() for name in str(spec).split(",")]
        if not names or any(n not in QUANTITIES for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"monitor must be {', '.join(QUANTITIES)} or a comma list of them (each next one "
                              f"breaks the ties of the one before), got {spec!r}")  # fmt: skip
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
            best = {"epoch": epoch, "step": step, "metric": metric, "value": scores[monitor.keys[0]], "monitor": spec,
                    "scores": scores, "weights": weights}  # fmt: skip
    return best


# ----------------------------------------------------------------------------------- the weights' moving average
def check_decay(decay: float | None) -> None:
    """ConfigError unless `decay` (an EMA's, `--ema`) is None or in (0, 1)."""
    if decay is not None and not 0 < decay < 1:
        raise ConfigError(f"ema must be a decay in (0, 1), e.g. 0.999, got {decay}")


WARMUP = (1, 10)  # d_t = (a + t) / (b + t) before it reaches DECAY


class WeightAverage:
    """The moving average of `model`'s parameters (see the module's docstring)."""

    def __init__(self, model: nn.Module, *, decay: float):
        check_decay(decay)
        self.decay, self.updates = decay, 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self._pairs = self._match(model)

    def _match(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine = dict(self.model.named_parameters())
        return [(mine[name], p) for name, p in model.named_parameters() if p.dtype.is_floating_point]

    def rate(self) -> float:
        """d_t of the next update."""
        t = self.updates + 1
        return min(self.decay, (WARMUP[0] + t) / (WARMUP[1] + t))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One update from `model` (the module trained, unwrapped): after each optimizer step."""
        weight = 1.0 - self.rate()
        shadows, params = [s for s, _ in self._pairs], [p.detach() for _, p in self._pairs]
        if shadows:
            torch._foreach_lerp_(shadows, params, weight)  # θ̄ += (1 − d_t)(θ − θ̄)
        for mine, theirs in zip(self.model.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        """{"decay", "updates", "weights": the shadow model's state_dict} (tensors on the CPU)."""
        weights = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return {"decay": self.decay, "updates": self.updates, "weights": weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["weights"])
        self.decay, self.updates = float(state["decay"]), int(state["updates"])
