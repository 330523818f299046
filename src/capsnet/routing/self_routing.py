"""Self-routing (Hahn, Pyeon & Kim, NeurIPS 2019): each child routes itself with its own small network.

"Self-Routing Capsule Networks", §3. No iterations and no agreement between capsules: for child i (pose u_i,
activation a_i) and parent j,

  û_j|i   vote W^pose_ij u_i                                          [B, n_in, n_out, d_out]
  c_ij    routing weight softmax_j(W^route_i u_i + b^route_i)        [B, n_in, n_out]
  a_j     Σ_i c_ij a_i / Σ_i a_i            (parent activation)      [B, n_out]
  u_j     Σ_i c_ij a_i û_j|i / Σ_i c_ij a_i (activation-weighted mean of the votes)   [B, n_out, d_out]

W^route and b^route start at 0, so every child starts routing uniformly (c_ij = 1/n_out). Since Σ_j c_ij = 1, the
parents' activations of a fully connected layer sum to 1: a distribution over the parents (the classes).

`SelfRoutingFC` connects every child to every parent; `SelfRoutingConv` the children in a k×k window
(all input types) to the parents at that location, weights shared over locations, and the sums over i above run
over the window.

Both run `capsnet.routing.self_routing_fast.fast_self_routing` by default (`fast=True`): the same function
without the votes, as large-K GEMMs with a hand-derived backward (differentiable once; set `layer.fast = False`
for double backward). `self_routing` below, the paper's computation as written, is the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import RoutingOutput, check_capsules, check_sizes, matrix_votes, matrix_weight_shape, votes
from .self_routing_fast import fast_self_routing

EPS = 1e-8  # keeps the two divisions finite where every activation is 0


def self_routing(
    u: torch.Tensor,
    a: torch.Tensor,
    pose_weight: torch.Tensor | None,
    route_weight: torch.Tensor,
    route_bias: torch.Tensor,
    *,
    matrix_pose: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """u [N, n_in, d_in], a [N, n_in] -> (parent poses [N, n_out, d_out], activations [N, n_out], c [N, n_in, n_out]).
    Without `pose_weight` only the activations are computed (poses None)."""
    logits = torch.einsum("nid,idj->nij", u, route_weight.to(u.dtype)) + route_bias.to(u.dtype)  # W^route_i u_i + b_i
    c = torch.softmax(logits, dim=2)  # c_ij = softmax over the parents j  [N, n_in, n_out]
    ca = c * a.unsqueeze(2)  # c_ij a_i  [N, n_in, n_out]
    a_out = ca.sum(dim=1) / (a.sum(dim=1, keepdim=True) + EPS)  # a_j = Σ_i c_ij a_i / Σ_i a_i  [N, n_out]
    if pose_weight is None:
        return None, a_out, c
    u_hat = (matrix_votes if matrix_pose else votes)(pose_weight, u)  # û_j|i = W^pose_ij u_i  [N, n_in, n_out, d_out]
    pose = torch.einsum("nij,nijd->njd", ca, u_hat) / (ca.sum(dim=1).unsqueeze(2) + EPS)  # u_j  [N, n_out, d_out]
    return pose, a_out, c


class _SelfRouting(nn.Module):
    fast: bool  # fast_self_routing (the constructors' `fast`); False: the reference self_routing

    def _route(self, u: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        route = fast_self_routing if self.fast else self_routing
        return route(u, a, self.pose_weight, self.route_weight, self.route_bias, matrix_pose=self.matrix_pose)

    def _init_weights(self, n_in: int, n_out: int, d_in: int, d_out: int, matrix_pose: bool, pose_out: bool = True):
        self.matrix_pose = matrix_pose  # W^pose_ij a √d×√d matrix acting on √d×√d pose matrices (the paper's 4×4)
        shape = matrix_weight_shape(type(self).__name__, n_in, n_out, d_in, d_out, matrix_pose)
        self.pose_weight = nn.Parameter(torch.empty(shape)) if pose_out else None
        self.route_weight = nn.Parameter(torch.zeros(n_in, d_in, n_out))  # W^route, zero: uniform routing at start
        self.route_bias = nn.Parameter(torch.zeros(n_in, n_out))
        if self.pose_weight is not None:
            nn.init.normal_(self.pose_weight, std=math.sqrt(1.0 / shape[2]))  # a vote keeps its child's scale


class SelfRoutingFC(_SelfRouting):
    """Fully connected self-routing capsule layer: u [B, in_caps, in_d] (+ activations a [B, in_caps]) ->
    poses [B, out_caps, out_d] and activations [B, out_caps]. Without `a`, every child has activation 1.

    `pose_out=False` (the paper's class layer, read only through its activations) has no pose weights; its
    capsules are then the activations themselves, [B, out_caps, 1].
    """

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int,
        *,
        matrix_pose: bool = False,
        pose_out: bool = True,
        fast: bool = True,
    ):
        super().__init__()
        check_sizes("SelfRoutingFC", in_caps, out_caps, in_d, out_d)
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, (out_d if pose_out else 1)
        self._init_weights(in_caps, out_caps, in_d, out_d, matrix_pose, pose_out)
        self.fast = fast

    def extra_repr(self) -> str:
        return f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}"

    def forward(
        self, u: torch.Tensor, a: torch.Tensor | None = None, *, return_weights: bool = False
    ) -> torch.Tensor | RoutingOutput:
        u = u.flatten(1, 3) if u.dim() == 5 else u  # a capsule grid [B, T, H, W, d] as T·H·W capsules
        a = a.flatten(1, 3) if a is not None and a.dim() == 4 else a
        check_capsules("SelfRoutingFC", u, self.in_caps, self.in_d, a)
        a = u.new_ones(u.shape[:2]) if a is None else a.to(u.dtype)
        pose, a_out, c = self._route(u, a)
        pose = a_out.unsqueeze(-1) if pose is None else pose
        return RoutingOutput(pose, c, a_out) if return_weights else pose


class SelfRoutingConv(_SelfRouting):
    """Convolutional self-routing capsule layer on capsule grids: poses [B, T, H, W, d_in] and activations
    [B, T, H, W] -> poses [B, T', H', W', d_out] and activations [B, T', H', W'] (no padding)."""

    def __init__(
        self,
        in_types: int,
        out_types: int,
        in_d: int,
        out_d: int,
        kernel_size: int = 3,
        stride: int = 1,
        *,
        matrix_pose: bool = False,
        fast: bool = True,
    ):
        super().__init__()
        check_sizes("SelfRoutingConv", in_types, out_types, in_d, out_d, kernel_size, stride)
        self.in_types, self.out_types, self.in_d, self.out_d = in_types, out_types, in_d, out_d
        self.k, self.stride = kernel_size, stride
        self._init_weights(in_types * kernel_size * kernel_size, out_types, in_d, out_d, matrix_pose)
        self.fast = fast

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, out_types={self.out_types}, in_d={self.in_d}, out_d={self.out_d}, "
            f"kernel_size={self.k}, stride={self.stride}"
        )

    def output_grid(self, size: int) -> int:
        return (size - self.k) // self.stride + 1

    def forward(self, u: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if u.dim() != 5 or u.shape[1] != self.in_types or u.shape[4] != self.in_d or a.shape != u.shape[:4]:
            raise ValueError(
                f"SelfRoutingConv expects poses [B, {self.in_types}, H, W, {self.in_d}] and activations "
                f"[B, {self.in_types}, H, W], got {list(u.shape)} and {list(a.shape)}"
            )
        b, t, h, w, d = u.shape
        ho, wo, kk = self.output_grid(h), self.output_grid(w), self.k * self.k
        both = torch.cat([u.permute(0, 1, 4, 2, 3), a.unsqueeze(2)], dim=2).reshape(b, t * (d + 1), h, w)
        cols = F.unfold(both, self.k, stride=self.stride).view(b, t, d + 1, kk, ho * wo)
        cols = cols.permute(0, 4, 1, 3, 2).reshape(b * ho * wo, t * kk, d + 1)  # children per location
        pose, a_out, _ = self._route(cols[..., :d], cols[..., d])
        assert pose is not None  # this layer has pose weights, so it always returns poses
        pose = pose.view(b, ho, wo, self.out_types, self.out_d).permute(0, 3, 1, 2, 4)
        return pose, a_out.view(b, ho, wo, self.out_types).permute(0, 3, 1, 2)
