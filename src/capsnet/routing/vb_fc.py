"""Variational Bayes routing between fully connected capsule layers (Ribeiro, Leontidis & Kollias, AAAI 2020): the
`--routing variational-bayes` layer of the paper's CapsNet.

Every child i votes for every parent j, and VB fits one Gaussian-Wishart component per parent to its votes
(`capsnet.routing.vb.vb_routing`):

  V_ij   vote W_ij u_i                                                       [B, n_in, n_out, out_d]
  R_ij   assignment of child i to parent j, 1/n_out at the start             [B, n_in, n_out]
  m_j    posterior mean of the votes weighted by R_ij a_i (the parent's pose), batch-normalised  [B, n_out, out_d]
  a_j    sigmoid(BN(β_a − (E[π_j] H[q(μ_j, Λ_j)] + β_u)))                    [B, n_out]

The paper's capsules are 4×4 matrices voting M_i W_ij (VBCapsNet's layers, capsnet.routing.vb_conv); CapsNet's
primary capsules are vectors, so here the vote is a linear map of the vector, as EMRoutingFC's is. The children's
activations a_i are given (CapsNet gives their lengths |u_i|) or 1.

Parameters: W [n_in, n_out, in_d, out_d], β_u and β_a [n_out] (from 0); VBNorm's running statistics.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import RoutingOutput, autocast_off, check_capsules, check_sizes, votes
from .dynamic import default_weight_std
from .vb import DEFAULT_PRIOR, VBNorm, VBPrior, routing_dtype, vb_routing


class VBRoutingFC(nn.Module):
    """Fully connected capsule layer with VB routing: u [B, in_caps, in_d] (+ activations a [B, in_caps]) -> poses
    m [B, out_caps, out_d] and activations [B, out_caps].

    Args:
        in_caps, out_caps, in_d, out_d: numbers of children and parents, and their dimensions (the Gaussians are
            over the out_d pose entries; the paper's 16 = 4×4).
        iterations: routing iterations (the authors': 3).
        weight_std: initial std of W (default: `capsnet.routing.dynamic.default_weight_std`, 1/√in_caps).
        prior: the priors (`capsnet.routing.vb.VBPrior`, the authors' α0 = κ0 = ψ0 = 1, ν0 = out_d + 1).
        batchnorm: the authors' BatchNorm of the poses and activation logits (`VBNorm`).
        min_normaliser: floor of Σ_j ρ_ij (`vb_routing`); default 0, the paper's R_ij, which sum to 1 over
            the parents as every routing layer's weights do (the authors' conv layers clamp at 1e-11).
    """

    activations = True  # returns the parents' activations a_j

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int = 16,
        iterations: int = 3,
        *,
        weight_std: float | None = None,
        prior: VBPrior = DEFAULT_PRIOR,
        batchnorm: bool = True,
        min_normaliser: float = 0.0,
    ):
        super().__init__()
        check_sizes("VBRoutingFC", in_caps, out_caps, in_d, out_d, iterations)
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.iterations, self.prior, self.min_normaliser = iterations, prior, min_normaliser
        self.weight_std = default_weight_std(in_caps) if weight_std is None else weight_std
        self.weight = nn.Parameter(torch.empty(in_caps, out_caps, in_d, out_d))  # W_ij  [I, J, d_in, d_out]
        self.beta_u = nn.Parameter(torch.zeros(out_caps))
        self.beta_a = nn.Parameter(torch.zeros(out_caps))
        self.norm = VBNorm(out_caps, enabled=batchnorm)
        nn.init.normal_(self.weight, std=self.weight_std)

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"iterations={self.iterations}"
        )

    def forward(
        self, u: torch.Tensor, a: torch.Tensor | None = None, *, return_weights: bool = False
    ) -> torch.Tensor | RoutingOutput:
        """u [B, in_caps, in_d], a [B, in_caps] or None (every child active) -> m [B, out_caps, out_d], or
        RoutingOutput(m, R [B, in_caps, out_caps], a_j [B, out_caps])."""
        check_capsules("VBRoutingFC", u, self.in_caps, self.in_d, a)
        dtype = routing_dtype(u)
        with autocast_off(u.device.type):  # in float32 (or 64): routing_dtype
            a = u.new_ones(u.shape[:2], dtype=dtype) if a is None else a.to(dtype)
            v = votes(self.weight.to(dtype), u.to(dtype))  # V_ij = W_ij u_i  [B, I, J, d_out]
            # vb_routing's layout: one parent position P = 1, votes [B, 1, J, I, d_out], child activations [B, 1, I]
            res = vb_routing(
                v.transpose(1, 2).unsqueeze(1),
                a.unsqueeze(1),
                self.beta_u.to(dtype),
                self.beta_a.to(dtype),
                iterations=self.iterations,
                prior=self.prior,
                min_normaliser=self.min_normaliser,
            )
        poses, acts = self.norm(res)  # [B, 1, J, d_out], [B, 1, J]
        if not return_weights:
            return poses[:, 0]
        return RoutingOutput(poses[:, 0], res.assignments[:, 0].transpose(1, 2), acts[:, 0])  # R_ij  [B, I, J]


__all__ = ["VBRoutingFC"]
