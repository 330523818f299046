"""An exponential moving average of the weights (`--ema DECAY`), scored on validation beside the raw weights.

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
from typing import Any

import torch
from torch import nn

from .selection import check_decay

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
