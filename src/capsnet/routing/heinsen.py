"""Heinsen's 2019 routing (An Algorithm for Routing Capsules in All Domains, arXiv:1911.00792, Algorithm 1): the
`--routing heinsen` layer of the paper's CapsNet, and the routing of the authors' smallNORB model (heinsen-capsnet).

Each child i, a matrix μ_i of `rows` × d_in/rows entries with an activation score, votes for every parent j; each
parent is a Gaussian over the entries of its votes, and an activation score that maximises "bang per bit", the
benefit of using the data it explains minus the cost of ignoring the rest:

  V_ij      = μ_i W_ij + B_ij                                          votes   [B, I, J, rows, c_out]
  f(a_i)    = sigmoid(a_i)                                             the child's probability  [B, I]
  E-step    R_ij = 1/J at first, then softmax_j(log f(a_j) + log p_ij)  [B, I, J]
            log p_ij = −Σ_ch (V_ijch − μ_jch)² / 2σ²_jch − Σ_ch log σ_jch   (a Gaussian without its constant)
  D-step    D^use_ij = f(a_i) R_ij,  D^ign_ij = f(a_i) − D^use_ij        [B, I, J]
  M-step    a_j = Σ_i β^use_ij D^use_ij − Σ_i β^ign_ij D^ign_ij          parent score ("bang per bit")  [B, J]
            μ_j = Σ_i D^use_ij V_ij / Σ_i D^use_ij,  σ²_j = Σ_i D^use_ij (V_ij − μ_j)² / Σ_i D^use_ij   [B, J, rows, c]

iterated r times (the paper: 3). "skm" (`p_model`) replaces log p_ij with soft k-means, log_softmax_j(−Σ (V − μ)²).

CapsNet's capsules are vectors: `rows` = 1 makes each a 1 × d matrix (as the authors' SST model routes vectors),
its activation |u_i| is f(a_i) itself, and the class probability is f(a_j) = sigmoid(a_j). The authors' smallNORB
model routes 4 × 4 matrices (`rows` = 4) with activation logits (`HeinsenRouting.route`). With `in_caps` = −1
any number of children routes through one W, B and β shared by all of them (the authors' n_inp = −1).

Parameters: W [I, J, c_in, c_out] (normal / c_in), B [I, J, rows, c_out], β^use and β^ign [I, J] (from 0); I is 1
when shared.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import RoutingOutput, autocast_off, check_capsules, check_sizes

P_MODELS = ("gaussian", "skm")


class HeinsenResult(NamedTuple):
    scores: torch.Tensor  # a_j, parent scores (logits of f(a_j))  [B, J]
    poses: torch.Tensor  # μ_j  [B, J, rows, c_out] (generative_routing: [B, J, E])
    variances: torch.Tensor  # σ²_j, as μ_j
    weights: torch.Tensor  # R_ij of the last iteration, summing to 1 over j  [B, I, J]


def generative_routing(
    p_in: torch.Tensor,
    v: torch.Tensor,
    beta_use: torch.Tensor,
    beta_ign: torch.Tensor,
    *,
    iterations: int = 3,
    p_model: str = "gaussian",
    eps: float = 1e-5,
) -> HeinsenResult:
    """Algorithm 1 on parent-major votes v [B, J, I, E] (E: the entries of a vote, rows·c_out), with the children's
    probabilities p_in = f(a_i) [B, I] and β^use, β^ign [I or 1, J].

    Parent-major, every sum over the children is one batched matrix product over (b, j) that reads v in place; the
    small tensors (R, D) are [B, J, I] inside, R is returned [B, I, J]."""
    n_out = v.shape[1]
    f_a = p_in[:, None]  # f(a_i)  [B, 1, I]
    b_use, b_ign = beta_use.T, beta_ign.T  # β_ij  [J, I or 1]
    r = v.new_full(v.shape[:3], 1.0 / n_out)  # E-step, first iteration: R_ij = 1/J  [B, J, I]
    a_out = mu = sig2 = dev2 = None
    for it in range(iterations):
        if it > 0:  # E-step: R_ij = softmax_j(log f(a_j) + log p_ij)
            assert a_out is not None and sig2 is not None and dev2 is not None
            if p_model == "gaussian":  # −Σ_e (V − μ)²/2σ² − Σ_e log σ  [B, J, I]
                log_p = -(dev2 @ (0.5 / sig2)[..., None]).squeeze(-1) - 0.5 * sig2.log().sum(-1, keepdim=True)
            else:  # soft k-means: log_softmax_j(−Σ_e (V − μ)²)
                log_p = torch.log_softmax(-dev2.sum(-1), dim=1)
            r = torch.softmax(F.logsigmoid(a_out)[..., None] + log_p, dim=1)
        d_use = f_a * r  # D-step: D^use_ij = f(a_i) R_ij  [B, J, I]
        d_ign = f_a - d_use  # D^ign_ij = f(a_i) − D^use_ij
        a_out = (b_use * d_use).sum(-1) - (b_ign * d_ign).sum(-1)  # M-step: a_j  [B, J]
        share = (d_use / (d_use.sum(-1, keepdim=True) + eps))[:, :, None]  # D^use_ij / Σ_i D^use_ij  [B, J, 1, I]
        mu = (share @ v).squeeze(2)  # μ_j  [B, J, E]
        dev2 = (v - mu[:, :, None]).square()  # (V_ij − μ_j)²  [B, J, I, E]
        sig2 = (share @ dev2).squeeze(2) + eps  # σ²_j  [B, J, E]
    assert a_out is not None and mu is not None and sig2 is not None
    return HeinsenResult(a_out, mu, sig2, r.transpose(1, 2))


class HeinsenRouting(nn.Module):
    """Heinsen's 2019 routing between fully connected capsule layers: u [B, in_caps, in_d] (+ probabilities a
    [B, in_caps]) -> parents μ_j [B, out_caps, out_d] and their probabilities f(a_j) [B, out_caps]. It routes in
    float32 (float64 for float64 inputs), under autocast too: σ² and log σ² are not for bf16.

    Args:
        in_caps, out_caps: numbers of children and parents (out_caps >= 2); in_caps −1: any number of children,
            sharing W, B and β (the authors' n_inp = −1).
        in_d, out_d: the capsules' sizes; each is a `rows` × (size / rows) matrix, read row-major.
        iterations: routing iterations r (the paper: 3).
        rows: d_cov, the rows of every capsule (1: vectors; the smallNORB model: 4).
        single_beta: β^ign is β^use (the authors' option).
        p_model: "gaussian" (the paper) or "skm" (soft k-means, the authors' option).
        eps: added to Σ_i D^use_ij and to σ² (the authors' 1e-5).
    """

    activations = True  # takes the children's probabilities and returns the parents' f(a_j)

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int,
        iterations: int = 3,
        *,
        rows: int = 1,
        single_beta: bool = False,
        p_model: str = "gaussian",
        eps: float = 1e-5,
    ):
        super().__init__()
        check_sizes("HeinsenRouting", out_caps, in_d, out_d, iterations, rows)
        if in_caps < 1 and in_caps != -1:
            raise ValueError(f"HeinsenRouting: in_caps must be >= 1, or -1 for any number, got {in_caps}")
        if out_caps < 2:
            raise ValueError(f"HeinsenRouting: routing needs at least 2 parents, got out_caps={out_caps}")
        if in_d % rows or out_d % rows:
            raise ValueError(f"HeinsenRouting: in_d {in_d} and out_d {out_d} must be multiples of rows {rows}")
        if p_model not in P_MODELS:
            raise ValueError(f"HeinsenRouting: p_model must be one of {', '.join(P_MODELS)}, got {p_model!r}")
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.iterations, self.rows, self.p_model, self.eps = iterations, rows, p_model, eps
        n, c_in, c_out = max(1, in_caps), in_d // rows, out_d // rows
        self.weight = nn.Parameter(torch.randn(n, out_caps, c_in, c_out) / c_in)  # W_ij  [I, J, c_in, c_out]
        self.bias = nn.Parameter(torch.zeros(n, out_caps, rows, c_out))  # B_ij  [I, J, rows, c_out]
        self.beta_use = nn.Parameter(torch.zeros(n, out_caps))  # β^use_ij
        self.beta_ign = self.beta_use if single_beta else nn.Parameter(torch.zeros(n, out_caps))  # β^ign_ij

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"iterations={self.iterations}, rows={self.rows}, p_model={self.p_model!r}"
        )

    def votes(self, mu: torch.Tensor) -> torch.Tensor:
        """V_ij = μ_i W_ij + B_ij, parent-major: μ [B, I, rows, c_in] -> [B, J, I, rows·c_out] (contiguous)."""
        w, b = self.weight.to(mu.dtype), self.bias.to(mu.dtype)
        n, i, rows = mu.shape[:3]
        if self.in_caps == -1:  # one W for every child: a single GEMM [B·I·rows, c_in] @ [c_in, J·c_out]
            j, c_in, c_out = w.shape[1:]
            v = (mu @ w[0].permute(1, 0, 2).reshape(c_in, j * c_out)).view(n, i, rows, j, c_out)
            v = v.permute(0, 3, 1, 2, 4).contiguous().add_(b[0][:, None])  # [B, J, I, rows, c_out]
        else:
            v = torch.einsum("bicd,ijdh->bjich", mu, w).contiguous().add_(b.transpose(0, 1))
        return v.view(n, v.shape[1], i, -1)

    def route(self, scores: torch.Tensor, mu: torch.Tensor) -> HeinsenResult:
        """The authors' interface: activation logits a_i [B, I] and matrices μ_i [B, I, rows, c_in] -> parent
        scores a_j [B, J], μ_j, σ²_j [B, J, rows, c_out] and R [B, I, J]."""
        return self._route(torch.sigmoid(scores), mu)

    def _route(self, p_in: torch.Tensor, mu: torch.Tensor) -> HeinsenResult:
        if self.in_caps != -1 and mu.shape[1] != self.in_caps:
            raise ValueError(f"HeinsenRouting expects {self.in_caps} children, got {mu.shape[1]}")
        dtype = torch.float64 if mu.dtype == torch.float64 else torch.float32  # (bf16 under autocast: fp32)
        with autocast_off(mu.device.type):
            p_in, mu = p_in.to(dtype), mu.to(dtype)
            beta_use, beta_ign = self.beta_use.to(dtype), self.beta_ign.to(dtype)
            res = generative_routing(
                p_in, self.votes(mu), beta_use, beta_ign, iterations=self.iterations, p_model=self.p_model, eps=self.eps
            )
        shape = (*res.poses.shape[:2], self.rows, -1)  # [B, J, rows, c_out]
        return res._replace(poses=res.poses.view(shape), variances=res.variances.view(shape))

    def forward(
        self, u: torch.Tensor, a: torch.Tensor | None = None, *, return_weights: bool = False
    ) -> torch.Tensor | RoutingOutput:
        """u [B, in_caps, in_d], a = f(a_i) [B, in_caps] in [0, 1] or None (every child present) -> μ_j
        [B, out_caps, out_d], or RoutingOutput(μ_j, R [B, in_caps, out_caps], f(a_j) [B, out_caps])."""
        check_capsules("HeinsenRouting", u, u.shape[1] if self.in_caps == -1 else self.in_caps, self.in_d, a)
        p_in = u.new_ones(u.shape[:2]) if a is None else a.to(u.dtype)
        res = self._route(p_in, u.unflatten(-1, (self.rows, self.in_d // self.rows)))
        poses = res.poses.flatten(-2)  # μ_j, row-major  [B, J, out_d]
        if not return_weights:
            return poses
        return RoutingOutput(poses, res.weights, torch.sigmoid(res.scores))


__all__ = ["P_MODELS", "HeinsenResult", "HeinsenRouting", "generative_routing"]
