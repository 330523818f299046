"""Losses: the margin loss (Eq. 4) and the decoder's reconstruction loss (§4.1)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


def capsule_lengths(v: torch.Tensor) -> torch.Tensor:
    """|v_k|, the probability that entity k is present.  [B, n, d] -> [B, n]."""
    return torch.linalg.vector_norm(v, dim=-1)


def full_precision(t: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 (autocast outputs) to float32 for the losses and probabilities; float32 and float64 as
    they are (a float64 model keeps float64 throughout)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _targets(labels: torch.Tensor, n_labels: int, like: torch.Tensor) -> torch.Tensor:
    """Class indices [B] -> one-hot [B, n]; multi-hot [B, n] is taken as it is."""
    if labels.dim() == 1:
        if labels.is_floating_point():
            raise ValueError("class-index labels must be an integer tensor of shape [B]")
        # one-hot by scatter: unlike F.one_hot on the CPU, no host read of the labels (a training step never waits)
        return like.new_zeros(labels.shape[0], n_labels).scatter_(1, labels.long()[:, None], 1.0)
    if labels.dim() == 2 and labels.shape[1] == n_labels:
        return labels.to(like.dtype)
    raise ValueError(f"labels must be class indices [B] or multi-hot targets [B, {n_labels}], got {list(labels.shape)}")


class MarginLoss(nn.Module):
    """Eq. 4: L_k = T_k max(0, m⁺ - |v_k|)² + λ (1 - T_k) max(0, |v_k| - m⁻)², summed over the classes k
    and averaged over the batch.

    Call as `loss(v, labels)` with capsules v [B, n, d] (or their lengths [B, n]) and labels either class
    indices [B] or multi-hot targets [B, n] (several digits present, as in MultiMNIST).

    `reduction="half-mean"` is the official TensorFlow code's form (Sabour et al., research/capsules
    `_margin_loss`): ½ L_k averaged over the batch *and* the classes, i.e. Eq. 4 divided by 2n.
    """

    def __init__(
        self,
        n_labels: int = 10,
        lambda_: float = 0.5,
        m_positive: float = 0.9,
        m_negative: float = 0.1,
        *,
        reduction: Literal["sum", "half-mean"] = "sum",
    ):
        super().__init__()
        if reduction not in ("sum", "half-mean"):
            raise ValueError(f"MarginLoss: reduction must be 'sum' or 'half-mean', got {reduction!r}")
        self.n_labels = n_labels
        self.reduction = reduction
        self.lambda_ = lambda_
        self.m_positive = m_positive
        self.m_negative = m_negative

    def extra_repr(self) -> str:
        return (
            f"n_labels={self.n_labels}, lambda_={self.lambda_}, "
            f"m_positive={self.m_positive}, m_negative={self.m_negative}"
            + (f", reduction={self.reduction!r}" if self.reduction != "sum" else "")
        )

    def forward(self, v: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lengths = capsule_lengths(v) if v.dim() == 3 else v  # |v_k|  [B, n]
        if lengths.dim() != 2 or lengths.shape[1] != self.n_labels:
            raise ValueError(
                f"MarginLoss expects capsules [B, {self.n_labels}, d] or lengths [B, {self.n_labels}], "
                f"got {list(v.shape)}"
            )
        t = _targets(labels, self.n_labels, lengths)  # T_k  [B, n]
        present = F.relu(self.m_positive - lengths) ** 2  # max(0, m⁺ - |v_k|)²
        absent = F.relu(lengths - self.m_negative) ** 2  # max(0, |v_k| - m⁻)²
        loss = t * present + self.lambda_ * (1.0 - t) * absent  # L_k  [B, n]
        if self.reduction == "half-mean":  # the official code: ½ L_k averaged over batch and classes
            return 0.5 * loss.mean()
        return loss.sum(dim=1).mean()


def reconstruction_loss(
    reconstructions: torch.Tensor,
    images: torch.Tensor,
    *,
    weight: float = 0.0005,
    reduction: Literal["sum", "mean"] = "sum",
) -> torch.Tensor:
    """§4.1: `weight` × the sum of squared pixel errors per image, averaged over the batch.

    `reduction="mean"` (a deviation some implementations use) averages over pixels instead of summing;
    with the paper's weight it makes the reconstruction term ~784× weaker.
    """
    if reconstructions.shape != images.shape:
        raise ValueError(
            f"reconstructions {list(reconstructions.shape)} and images {list(images.shape)} differ in shape"
        )
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    err = (reconstructions - images).pow(2).flatten(1)  # [B, pixels]
    per_image = err.sum(dim=1) if reduction == "sum" else err.mean(dim=1)
    return weight * per_image.mean()


def margin_plus_reconstruction(
    margin: torch.Tensor,
    reconstructions: torch.Tensor | None,
    images: torch.Tensor,
    *,
    weight: float,
    reduction: Literal["sum", "mean"],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """§4.1's total, margin + `weight` × reconstruction error (no reconstruction term without reconstructions or
    at weight 0), and its parts as detached 0-d tensors on the loss's device: reading them is left to the caller,
    so a training step never waits."""
    total, parts = margin, {"margin": margin.detach()}
    if reconstructions is not None and weight > 0:
        recon = reconstruction_loss(reconstructions, images, weight=weight, reduction=reduction)
        total = total + recon
        parts["reconstruction"] = recon.detach()
    parts["total"] = total.detach()
    return total, parts


def spread_margin(progress: float, start: float = 0.2, end: float = 0.9) -> float:
    """Matrix capsules §4: the spread loss's margin m grows linearly from 0.2 to 0.9 over training
    ("by starting with a small margin of 0.2 and linearly increasing it during training to 0.9, we avoid dead
    capsules in the earlier layers"). `progress` in [0, 1] is the fraction of the annealing done (clamped)."""
    return start + (end - start) * min(1.0, max(0.0, progress))


class SpreadLoss(nn.Module):
    """Matrix capsules Eq. 3: L = Σ_{i≠t} max(0, m − (a_t − a_i))², the target activation a_t pushed at least m above
    every other a_i; averaged over the batch. Call as `loss(a, labels, margin)` with activations a [B, n] and class
    indices [B]."""

    def __init__(self, n_labels: int):
        super().__init__()
        self.n_labels = n_labels

    def forward(self, activations: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
        if activations.dim() != 2 or activations.shape[1] != self.n_labels:
            raise ValueError(f"SpreadLoss expects activations [B, {self.n_labels}], got {list(activations.shape)}")
        if labels.dim() != 1 or labels.is_floating_point():
            raise ValueError("SpreadLoss takes class indices [B] (one class per image)")
        a_t = activations.gather(1, labels.long().view(-1, 1))  # [B, 1]
        loss = F.relu(margin - (a_t - activations)) ** 2  # [B, n]; the i = t term is m², removed below
        others = 1.0 - _targets(labels, self.n_labels, loss)  # (by scatter: no host read of the labels)
        return (loss * others).sum(dim=1).mean()
