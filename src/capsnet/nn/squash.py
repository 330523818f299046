"""The squash non-linearity (Eq. 1): short vectors shrink to almost zero, long ones to a length just below 1."""

from __future__ import annotations

import torch
from torch import nn


def squash(s: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """Eq. 1: v = |s|² / (1 + |s|²) · s / |s|.

    Short vectors shrink to almost zero and long ones to a length just below 1; the direction is kept.
    `eps` inside the square root keeps the gradient finite at s = 0.
    """
    sq_norm = (s * s).sum(dim=dim, keepdim=True)  # |s|²
    return s * (sq_norm / ((1.0 + sq_norm) * torch.sqrt(sq_norm + eps)))


class Squash(nn.Module):
    """Module form of `squash` over the last dimension."""

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return squash(s, dim=-1, eps=self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


def efficient_squash(s: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """Efficient-CapsNet's squash (Mazzia et al. 2021, Eq. 2): v = (1 − e^{−|s|}) · s / |s|.

    Like `squash` it keeps the direction and maps lengths into [0, 1), but it is less steep near 0
    (|v| ≈ |s| for short vectors) and saturates more slowly. `eps` inside the square root keeps the
    gradient finite at s = 0.
    """
    norm = torch.sqrt((s * s).sum(dim=dim, keepdim=True) + eps)  # |s|
    return s * (-torch.expm1(-norm) / norm)  # 1 − e^{−|s|} = −expm1(−|s|), exact for small |s|
