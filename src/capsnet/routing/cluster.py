"""Non-iterative cluster routing (Zhao & Cheng, Neural Networks 2021): the routing step, and the fully connected
layer that is `--routing cluster` of the paper's CapsNet.

Every child i sends every parent j a cluster of K votes instead of one. The parent takes each cluster's centroid,
weighted by how tight the cluster is (the smaller its spread, the larger its weight), and a LayerNorm follows; one
pass, no iterations:

  V^k_ij   vote k of child i for parent j: W^k_ij u_i + b^k_ij                       [B, I, K, J, D]
  μ_ij     centroid  (1/K) Σ_k V^k_ij                                                [B, I, J, D]
  σ_ij     spread    sqrt((1/K) Σ_k (V^k_ij − μ_ij)²), per dimension                 [B, I, J, D]
  c_ij     weight    softmax_i(−log σ_ij), over the children, per dimension          [B, I, J, D]
  s_j      Σ_i c_ij μ_ij                                                             [B, J, D]
  v_j      LayerNorm(s_j), one LayerNorm (γ, β of D) shared by the parents           [B, J, D]

as the authors' released code computes it (github.com/ZHAOZHIHAO/ClusterRouting, src/capsule_network.py: the
population std of each dimension, `torch.std_mean(..., unbiased=False)`). Here −log σ is −½ log σ²: one log, no
square root; softmax_i(−log σ) = σ⁻¹ / Σ_i σ⁻¹.

The weights c_ij sum to 1 over the children, one set per dimension. What the layer reports as its routing weights
([B, I, J], RoutingOutput.weights, which every routing layer gives summed to 1 over the parents) is each child's
mean weight over the dimensions, c̄_ij, normalised over its parents: the share of child i's weight that goes to j.
`ClusterRoutingFC.coefficients` gives the c_ij themselves.

The convolutional layer of the authors' models is capsnet.routing.cluster_conv.ClusterRoutingConv.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import RoutingOutput, autocast_off, check_capsules, check_sizes

VOTES = 8  # K, votes per cluster: the authors' default (main.py --K 8, their CIFAR-10 command)


def combine(mean: torch.Tensor, var: torch.Tensor, *, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """s_j and c_ij from the clusters' centroids μ and variances σ², the children along `dim`:
    c_ij = softmax_i(−log σ_ij) = σ_ij⁻¹ / Σ_i σ_ij⁻¹, s_j = Σ_i c_ij μ_ij. σ² is floored at the dtype's smallest
    normal number (a cluster of identical votes would otherwise weigh infinitely)."""
    r = var.clamp_min(torch.finfo(var.dtype).tiny).rsqrt()  # σ_ij⁻¹  [B, I, J, D]
    total = r.sum(dim=dim, keepdim=True)  # Σ_i σ_ij⁻¹  [B, 1, J, D]
    s = (r * mean).sum(dim=dim) / total.squeeze(dim)  # s_j = Σ_i c_ij μ_ij  [B, J, D]
    return s, r / total  # c_ij  [B, I, J, D]


class _ClusterRoute(torch.autograd.Function):
    """The routing step with its backward written out, every tensor kept-dim: votes [.., I, .., K, ..] ->
    (s_j, c_ij). Autograd's var_mean and its backward make several passes over the K-fold votes and allocate as
    many copies; this makes three passes and one copy forward, two passes and the gradient backward."""

    @staticmethod
    def forward(ctx: Any, votes: torch.Tensor, child_dim: int, vote_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = votes.shape[vote_dim]
        mean = votes.mean(dim=vote_dim, keepdim=True)  # μ_ij
        # σ²_ij (a sum over the middle axis K is a fast reduction on CPU; vector_norm and var_mean there are not)
        var = (votes - mean).square_().sum(dim=vote_dim, keepdim=True).div_(k)
        floored = var < torch.finfo(var.dtype).tiny
        r = var.clamp_min(torch.finfo(var.dtype).tiny).rsqrt()  # σ_ij⁻¹
        total = r.sum(dim=child_dim, keepdim=True)  # Σ_i σ_ij⁻¹
        c = r / total  # c_ij = softmax_i(−log σ_ij)
        s = (c * mean).sum(dim=child_dim, keepdim=True)  # s_j = Σ_i c_ij μ_ij
        ctx.save_for_backward(votes, mean, r, c, floored)
        ctx.dims = (child_dim, vote_dim)
        return s, c

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_s: torch.Tensor, g_c: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        votes, mean, r, c, floored = ctx.saved_tensors
        child_dim, vote_dim = ctx.dims
        k = votes.shape[vote_dim]
        g_mean = c * g_s  # ∂L/∂μ_ij through s_j
        g_coeff = g_s * mean if g_c is None else g_s * mean + g_c  # ∂L/∂c_ij
        g_r = (g_coeff - (c * g_coeff).sum(dim=child_dim, keepdim=True)) * c / r  # c = r / Σr
        g_var = (g_r * r.pow(3) * -0.5).masked_fill_(floored, 0.0)  # r = σ²^(−½); 0 below the floor
        # ∂μ/∂V^k = 1/K, ∂σ²/∂V^k = 2 (V^k − μ) / K
        return (votes - mean).mul_(g_var * (2.0 / k)).add_(g_mean / k), None, None


def cluster_route(votes: torch.Tensor, *, child_dim: int = 1, vote_dim: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing step on votes laid out [..., I (child_dim), ..., K (vote_dim), ...]: returns (s_j, c_ij), s with
    both axes removed and c with the vote axis removed; e.g. votes [B, I, K, J, D] -> s [B, J, D], c [B, I, J, D].
    Differentiable once (its backward is written out: _ClusterRoute). float64 votes are routed in float64, any
    other (e.g. bf16 under autocast) in float32: σ² of a few votes loses every digit in bf16."""
    if votes.dtype != torch.float64:
        votes = votes.float()
    with autocast_off(votes.device.type):
        s, c = _ClusterRoute.apply(votes, child_dim, vote_dim)
    return s.squeeze(vote_dim).squeeze(child_dim), c.squeeze(vote_dim)


def cluster_moments(
    u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """μ_ij and σ²_ij of the votes V^k_ij = W^k_ij u_i + b^k_ij without forming them: with ũ_i = [u_i, 1] and
    W̃^k_ij = [W^k_ij, b^k_ij] (so V^k = W̃^k ũ), μ = W̄ ũ and σ²_ijd = ũ_iᵀ M_ijd ũ_i, M_ijd the second moment
    (1/K) Σ_k a^k a^kᵀ of the centred rows a^k = W̃^k_ij[d] − W̄_ij[d]. One GEMM per child for each, [B, P] @
    [P, J·D] and [B, P(P+1)/2] @ [P(P+1)/2, J·D] (P = in_d + 1, M's upper triangle), against [B, N] @ [N, K·J·D]
    and the K-fold votes tensor: the fast path where P(P+1)/2 < K·P, i.e. in_d < 2K − 2, and the batch is large
    enough to pay for M (`moments_pay`).
    u [B, I, N], weight [I, N, K, J, D], bias [I, K, J, D] or None -> (μ, σ²), each [I, B, J, D] (children first).
    """
    n_in, n, k, n_out, d = weight.shape
    b = u.shape[0]
    b_col = u.new_zeros(n_in, 1, k, n_out, d) if bias is None else bias.to(u.dtype).unsqueeze(1)  # [I, 1, K, J, D]
    w = torch.cat([weight.to(u.dtype), b_col], dim=1)  # W̃  [I, P, K, J, D]
    w_bar = w.mean(dim=2)  # W̄  [I, P, J, D]
    a = w - w_bar.unsqueeze(2)  # centred rows a^k  [I, P, K, J, D]
    rows, cols = torch.triu_indices(n + 1, n + 1, device=u.device)
    twice = torch.where(rows == cols, 1.0, 2.0).to(u.dtype)  # off-diagonal terms appear twice in ũᵀMũ
    rows_k = a.flatten(3).permute(0, 3, 1, 2)  # a^k as columns  [I, J·D, P, K]
    second = torch.matmul(rows_k, rows_k.transpose(2, 3)) / k  # M_ijd = (1/K) Σ_k a^k a^kᵀ  [I, J·D, P, P]
    m = second[:, :, rows, cols].transpose(1, 2) * twice.view(1, -1, 1)  # upper triangle, off-diagonal ×2  [I, T, J·D]
    u1 = torch.cat([u, u.new_ones(b, n_in, 1)], dim=2).transpose(0, 1)  # ũ  [I, B, P]
    outer = u1[:, :, rows] * u1[:, :, cols]  # ũ_p ũ_q, p <= q  [I, B, T]
    var = torch.bmm(outer, m.reshape(n_in, -1, n_out * d)).view(n_in, b, n_out, d)  # σ² = ũᵀ M ũ  [I, B, J, D]
    mean = torch.bmm(u1, w_bar.reshape(n_in, n + 1, n_out * d)).view(n_in, b, n_out, d)  # μ = W̄ ũ  [I, B, J, D]
    return mean, var


def moments_pay(batch: int, in_d: int, votes: int) -> bool:
    """Whether `cluster_moments` is the cheaper path: per image it multiplies P(P+1)/2 numbers per output
    against the votes' P·K (P = in_d + 1), and per step it forms M once, P²·K per output in small batched matmuls
    (measured at about twice their multiply count in time): it pays from a batch of 2P²K / (PK − P(P+1)/2) images,
    48 at CapsNet's 1152 × 8 → 10 × 16 with K = 8 (docs/benchmarks.md)."""
    p = in_d + 1
    return batch * (p * votes - p * (p + 1) // 2) >= 2 * p * p * votes


class ClusterRoutingFC(nn.Module):
    """Fully connected capsule layer with cluster routing: u [B, in_caps, in_d] -> v [B, out_caps, out_d].

    Args:
        in_caps, out_caps, in_d, out_d: numbers of children and parents and their dimensions.
        iterations: ignored (cluster routing does not iterate); taken so that every routing builds alike.
        votes: K, votes in each cluster (the authors' default 8).
        bias: a bias b^k_ij on each vote (the authors' transforms are biased convolutions: their default).
        norm: the LayerNorm of the parents (the authors' `acti`); False leaves s_j as it is.
        fast: compute μ and σ² with `cluster_moments` where that is cheaper (`moments_pay`: in_d <
            2K − 2 and a batch that pays for forming M); False always forms the K votes (the computation as written).

    Parameters: W [I, in_d, K, J, D] and b [I, K, J, D], drawn as PyTorch draws a linear map's from in_d inputs
    (U(±1/√in_d), the authors' convolutions' default rule); γ = 1 and β = 0 of the LayerNorm.
    """

    probability = "classifier"  # the parents are LayerNorm'd: a shared linear classifier reads the classes

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int,
        iterations: int = 1,
        *,
        votes: int = VOTES,
        bias: bool = True,
        norm: bool = True,
        fast: bool = True,
    ):
        super().__init__()
        check_sizes("ClusterRoutingFC", in_caps, out_caps, in_d, out_d, votes)
        if votes < 2:
            raise ValueError(f"ClusterRoutingFC: a cluster needs at least 2 votes to have a spread, got votes={votes}")
        self.in_caps, self.out_caps, self.in_d, self.out_d, self.votes = in_caps, out_caps, in_d, out_d, votes
        self.iterations, self.fast = 1, fast
        bound = 1.0 / math.sqrt(in_d)
        self.weight = nn.Parameter(torch.empty(in_caps, in_d, votes, out_caps, out_d).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(in_caps, votes, out_caps, out_d).uniform_(-bound, bound)) if bias else None
        self.norm = nn.LayerNorm(out_d) if norm else None

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"votes={self.votes}, bias={self.bias is not None}"
        )

    def cluster_votes(self, u: torch.Tensor) -> torch.Tensor:
        """V^k_ij = W^k_ij u_i + b^k_ij for all i, k, j: u [B, I, N] -> [I, B, K, J, D] (children first: one
        batched GEMM over the children, [B, N] @ [N, K·J·D] each)."""
        n_in, n_out, k, d = self.in_caps, self.out_caps, self.votes, self.out_d
        w = self.weight.to(u.dtype).view(n_in, self.in_d, k * n_out * d)  # [I, N, K·J·D]
        if self.bias is None:
            v = torch.bmm(u.transpose(0, 1), w)  # [I, B, K·J·D]
        else:
            v = torch.baddbmm(self.bias.to(u.dtype).view(n_in, 1, -1), u.transpose(0, 1), w)
        return v.view(n_in, u.shape[0], k, n_out, d)

    def route(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, I, N] -> (s_j [B, J, D], c_ij [I, B, J, D]); in float64 for float64 u, else in float32."""
        u = u if u.dtype == torch.float64 else u.float()
        with autocast_off(u.device.type):
            if self.fast and moments_pay(u.shape[0], self.in_d, self.votes):
                mean, var = cluster_moments(u, self.weight, self.bias)  # μ_ij, σ²_ij  [I, B, J, D]
                return combine(mean, var, dim=0)
            return cluster_route(self.cluster_votes(u), child_dim=0, vote_dim=2)

    def coefficients(self, u: torch.Tensor) -> torch.Tensor:
        """The routing weights c_ij for u [B, I, N]: [B, I, J, D], summing to 1 over the children i."""
        return self.route(u)[1].transpose(0, 1)

    def forward(
        self, u: torch.Tensor, a: torch.Tensor | None = None, *, return_weights: bool = False
    ) -> torch.Tensor | RoutingOutput:
        """u [B, in_caps, in_d] (a: ignored, cluster routing takes no activations) -> v [B, out_caps, out_d], or
        RoutingOutput(v, weights [B, in_caps, out_caps] (see the module's docstring), None)."""
        check_capsules("ClusterRoutingFC", u, self.in_caps, self.in_d, a)
        s, c = self.route(u)  # s_j [B, J, D], c_ij [I, B, J, D]
        v = (
            s if self.norm is None else F.layer_norm(s, (self.out_d,), self.norm.weight, self.norm.bias, self.norm.eps)
        )  # v_j = LayerNorm(s_j)
        if not return_weights:
            return v
        share = c.mean(dim=3)  # c̄_ij  [I, B, J]
        return RoutingOutput(v, (share / share.sum(dim=2, keepdim=True)).transpose(0, 1))  # [B, I, J]


__all__ = ["VOTES", "ClusterRoutingFC", "cluster_moments", "cluster_route", "combine", "moments_pay"]
