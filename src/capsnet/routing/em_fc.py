"""EM routing between fully connected capsule layers (Hinton, Sabour & Frosst, ICLR 2018, Procedure 1): the
`--routing em` layer of the paper's CapsNet.

Every child i votes for every parent j, and EM fits one Gaussian per parent to the 16 components of its votes:

  V_ij   vote W_ij u_i                                                  [B, n_in, n_out, 16]
  R_ij   assignment of child i to parent j, uniform 1/n_out at the start [B, n_in, n_out]
  μ_j    mean of the votes weighted by R_ij a_i  (the parent's pose)     [B, n_out, 16]
  a_j    sigmoid(λ (β_a − Σ_h (β_u + log σ_jh) Σ_i R_ij a_i))            [B, n_out]

with `capsnet.routing.em.em_routing` (its λ schedule, σ² floor and Gritzman's data normalisation). The
paper's capsules are 4×4 matrices voting M_i W_ij; CapsNet's primary capsules are vectors of any size, so here the
vote is a linear map of the vector, as dynamic routing's is (EMCapsNet's ConvCaps and ClassCaps are the matrix
form). The children's activations a_i are given (CapsNet gives their lengths |u_i|) or 1; the parents' a_j are
the layer's activations, each class's probability.

Parameters: W [n_in, n_out, d_in, 16], β_u and β_a [n_out] (from 0).
"""

from __future__ import annotations

import torch
from torch import nn

from ..configs.base import FINAL_LAMBDA, TRAINED_MIN_VAR
from .base import RoutingOutput, check_capsules, check_sizes, votes
from .dynamic import default_weight_std
from .em import em_routing

POSE = 16  # EM's Gaussians are over the 16 entries of a 4×4 pose


class EMRoutingFC(nn.Module):
    """Fully connected capsule layer with EM routing: u [B, in_caps, in_d] (+ activations a [B, in_caps]) -> poses
    μ [B, out_caps, 16] and activations [B, out_caps].

    Args:
        in_caps, out_caps, in_d: numbers of children and parents, and the children's dimension.
        out_d: the parents' dimension; EM routing's Gaussians are over 16 pose entries, so it must be 16.
        iterations: EM iterations r (the paper: 3).
        weight_std: initial std of W (default: `capsnet.routing.dynamic.default_weight_std`, 1/√in_caps).
        final_lambda, min_var: λ_final and the σ² floor of `em_routing` (defaults: the authors' λ and
            TRAINED_MIN_VAR, the floor EMCapsNet trains with).
    """

    activations = True  # returns the parents' activations a_j

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int = POSE,
        iterations: int = 3,
        *,
        weight_std: float | None = None,
        final_lambda: float = FINAL_LAMBDA,
        min_var: float = TRAINED_MIN_VAR,
    ):
        super().__init__()
        check_sizes("EMRoutingFC", in_caps, out_caps, in_d, out_d, iterations)
        if out_d != POSE:
            raise ValueError(f"EMRoutingFC: EM routing's parents have {POSE} pose entries (4×4), got out_d={out_d}")
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.iterations, self.final_lambda, self.min_var = iterations, final_lambda, min_var
        self.weight_std = default_weight_std(in_caps) if weight_std is None else weight_std
        self.weight = nn.Parameter(torch.empty(in_caps, out_caps, in_d, out_d))  # W_ij  [I, J, d_in, 16]
        self.beta_u = nn.Parameter(torch.zeros(out_caps))
        self.beta_a = nn.Parameter(torch.zeros(out_caps))
        nn.init.normal_(self.weight, std=self.weight_std)

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"iterations={self.iterations}"
        )

    def forward(
        self, u: torch.Tensor, a: torch.Tensor | None = None, *, return_weights: bool = False
    ) -> torch.Tensor | RoutingOutput:
        """u [B, in_caps, in_d], a [B, in_caps] or None (every child active) -> μ [B, out_caps, 16], or
        RoutingOutput(μ, R [B, in_caps, out_caps], a_j [B, out_caps])."""
        check_capsules("EMRoutingFC", u, self.in_caps, self.in_d, a)
        a = u.new_ones(u.shape[:2]) if a is None else a.to(u.dtype)
        v = votes(self.weight, u)  # V_ij = W_ij u_i  [B, I, J, 16]
        # em_routing's layout: one parent position P = 1, votes [B, 1, J, I, 16], child activations [B, 1, I]
        res = em_routing(
            v.transpose(1, 2).unsqueeze(1),
            a.unsqueeze(1),
            self.beta_u,
            self.beta_a,
            iterations=self.iterations,
            final_lambda=self.final_lambda,
            min_var=self.min_var,
        )
        poses, acts = res.poses[:, 0], res.activations[:, 0]  # μ_j [B, J, 16], a_j [B, J]
        if not return_weights:
            return poses
        return RoutingOutput(poses, res.assignments[:, 0].transpose(1, 2), acts)  # R_ij  [B, I, J]


__all__ = ["POSE", "EMRoutingFC"]
