"""Variational Bayes routing (Ribeiro, Leontidis & Kollias, AAAI 2020, "Capsule Routing via Variational Bayes"),
vectorised over the batch, the parent positions and the children in each parent's receptive field.

Each parent j is a Gaussian component over the D pose entries of the votes V_ij it receives, with a Dirichlet
prior on the mixing proportions π and a Gaussian-Wishart prior on its mean and (diagonal) precision Λ_j; mean-field
VB alternates two updates, as in Bishop 2006 §10.2 (his equation numbers below; the paper's own text was not
read here, the updates are the authors' released code's):

- update q(π, μ, Λ) (per parent j), with R'_ij = R_ij a_i (the children's activations weigh their votes):
  R_j = Σ_i R'_ij, μ̄_j = Σ_i R'_ij V_ij / R_j (10.51-52);  α_j = α0 + R_j (10.58);  κ_j = κ0 + R_j (10.60);
  m_j = (R_j μ̄_j + κ0 m0) / κ_j (10.61);  Ψ_j⁻¹ = Ψ0⁻¹ + Σ_i R'_ij (V_ij − μ̄_j)² + κ0 R_j / κ_j (μ̄_j − m0)²
  (10.62, diagonal);  ν_j = ν0 + R_j (10.63);
- update q(z) (per child i):  E[ln π_j] = ψ(α_j) − ψ(Σ_j' α_j') (10.66);
  E[ln |Λ_j|] = Σ_{d<D} ψ((ν_j − d)/2) + D ln 2 + ln |Ψ_j| (10.65);
  E[(V − μ_j)ᵀ Λ_j (V − μ_j)] = D/κ_j + ν_j Σ_h (V_ijh − m_jh)² / Ψ⁻¹_jh (10.64);
  ln ρ_ij = E[ln π_j] + ½ E[ln |Λ_j|] − ½ D ln 2π − ½ E[(V − μ)ᵀ Λ (V − μ)] (10.46);
  R_ij = ρ_ij / Σ_{j' ∈ parents(i)} ρ_ij' (10.49; over every parent the child reaches, at all positions);
- the parent's activation from the entropy of q(μ_j, Λ_j):  H_j = ½ D ln(2πe) − ½ E[ln |Λ_j|],
  â_j = β_a − (E[π_j] H_j + β_u), with E[π_j] = exp(E[ln π_j]) as the authors' code; the layers then batch-normalise
  â_j (and m_j) and take a_j = sigmoid(BN(â_j)) (`VBNorm`).

As the authors' released code (fabio-deep/Variational-Capsule-Routing, vb_routing.py): R starts uniform, 1/J per
slot; the last iteration updates q(π, μ, Λ) only; m0 = 0, Ψ0 = I/ψ0. Their normaliser of R is clamped below at
1e-11 (`min_normaliser`; here in the log domain, the same values: ln R = ln ρ − max(ln Σ ρ, ln 1e-11)), so a child
whose votes are far from every parent is dropped (its R_ij ≈ 0) instead of being shared out as the paper's
normalisation does; VBCapsNet's layers keep the clamp, CapsNet's VBRoutingFC the paper's R (summing to 1).

Speed: as EM routing (capsnet.routing.em) the Gaussian's sufficient statistics (V, V²) are stacked once into
U = [V − c, (V − c)²]  [B, P, J, I, 2D] (c: each parent's unweighted mean vote, so that Σ R'V² − R μ̄² does not
cancel); both updates are then contractions of U with small tensors (batched [1, I] @ [I, 2D] and [1, 2D] @ [2D, I]),
and no [B, P, J, I, D] tensor is made per iteration. The backward pass is written by hand (`_VBRouting`):
the small graph is replayed under autograd with the saved contractions and ∂U is formed once.

Shapes: B batch, P parent positions, J parent types, I children in a parent's receptive field (slots), D pose entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .em import Replayed, child_normalizer

MIN_NORMALISER = 1e-11  # the authors' clamp of Σ_j ρ_ij
_LOG_2PI = math.log(2.0 * math.pi)


class VBPrior(NamedTuple):
    """The priors (the authors' defaults): Dirichlet α0; Gaussian precision scale κ0 (mean m0 = 0); Wishart degrees
    of freedom ν0 (None: D + 1) and scale Ψ0 = I / ψ0 (Ψ0⁻¹ = ψ0 I, added to the scatter)."""

    alpha0: float = 1.0
    kappa0: float = 1.0
    nu0: float | None = None
    psi0: float = 1.0


DEFAULT_PRIOR = VBPrior()


class VBResult(NamedTuple):
    poses: torch.Tensor  # m_j, the posterior means (before VBNorm)  [B, P, J, D]
    logits: torch.Tensor  # â_j = β_a − (E[π_j] H_j + β_u), before VBNorm  [B, P, J]
    assignments: torch.Tensor  # R_ij used by the final update of q(π, μ, Λ)  [B, P, J, I]


class _Options(NamedTuple):
    shape: tuple[int, int, int, int, int]  # B, P, J, I, D
    iterations: int
    prior: VBPrior
    nu0: float
    child_index: torch.Tensor | None
    n_children: int | None
    min_normaliser: float


def _parameters(stats_sum, w, c, opts: _Options):
    """Update q(π, μ, Λ) from R'_ij = w [B, P, J, I] and Σ_i R'_ij U_ij (`stats_sum` [B, P, J, 2D]): (α_j [B, P, J],
    m_j, Ψ⁻¹_j [B, P, J, D], κ_j, ν_j [B, P, J], E[ln |Λ_j|] [B, P, J])."""
    d, prior = c.shape[-1], opts.prior
    r_j = w.sum(dim=-1)  # R_j = Σ_i R'_ij  [B, P, J]
    stats = stats_sum / r_j.unsqueeze(-1)  # [E(V − c), E(V − c)²] under R'  [B, P, J, 2D]
    mu_c = stats[..., :d]  # μ̄_j − c  [B, P, J, D]
    scatter = r_j.unsqueeze(-1) * (stats[..., d:] - mu_c * mu_c)  # Σ_i R'_ij (V_ij − μ̄_j)²  [B, P, J, D]
    mu = mu_c + c  # μ̄_j
    alpha, kappa, nu = prior.alpha0 + r_j, prior.kappa0 + r_j, opts.nu0 + r_j  # [B, P, J]
    m = (r_j / kappa).unsqueeze(-1) * mu  # m_j = (R_j μ̄_j + κ0 m0) / κ_j with m0 = 0  [B, P, J, D]
    inv_psi = prior.psi0 + scatter + (prior.kappa0 * r_j / kappa).unsqueeze(-1) * mu * mu  # Ψ⁻¹_j (diag)  [B, P, J, D]
    # E[ln |Λ_j|] = Σ_{d<D} ψ((ν_j − d)/2) + D ln 2 + ln |Ψ_j|,  ln |Ψ_j| = −Σ_h ln Ψ⁻¹_jh  [B, P, J]
    half = 0.5 * (nu.unsqueeze(-1) - torch.arange(d, dtype=nu.dtype, device=nu.device))
    e_ln_lambda = digamma(half).sum(dim=-1) + d * math.log(2.0) - torch.log(inv_psi).sum(dim=-1)
    return alpha, m, inv_psi, kappa, nu, e_ln_lambda


def digamma(x: torch.Tensor) -> torch.Tensor:
    """ψ(x) for x > 0: torch.digamma, and while a graph is exported (ONNX has no digamma) the same function from
    ψ(x) = ψ(x + 6) − Σ_{k<6} 1/(x + k) and the asymptotic series ψ(y) ≈ ln y − 1/2y − 1/12y² + 1/120y⁴ − 1/252y⁶
    + 1/240y⁸ at y = x + 6 ≥ 6 (the next term, 1/132y¹⁰, is under 2e-10)."""
    if not torch.compiler.is_exporting():
        return torch.digamma(x)
    shift = sum(1.0 / (x + k) for k in range(6))
    inv = 1.0 / (x + 6.0)
    inv2 = inv * inv
    series = inv2 * (1 / 12 - inv2 * (1 / 120 - inv2 * (1 / 252 - inv2 / 240)))
    return torch.log(x + 6.0) - 0.5 * inv - series - shift


def _e_ln_pi(alpha: torch.Tensor) -> torch.Tensor:
    """E[ln π_j] = ψ(α_j) − ψ(Σ_j' α_j'), over the parent types at each position  [B, P, J]."""
    return digamma(alpha) - digamma(alpha.sum(dim=2, keepdim=True))


def _vb_loop(contract_w, contract_theta, c, a, beta_u, beta_a, opts: _Options):
    """The VB updates on the small tensors; the two contractions with U = [V − c, (V − c)²] come from the caller
    (`contract_w(t, w)` = Σ_i w_ij U_ij [B, P, J, 2D]; `contract_theta(t, θ)` = U_ij · θ_j [B, P, J, I]).
    c [B, P, J, D], a [B, P, 1, I], β [J]. Returns (m [B, P, J, D], â [B, P, J], R [B, P, J, I])."""
    bsz, p, j, i, d = opts.shape
    r = c.new_full((1, 1, 1, 1), 1.0 / j).expand(bsz, p, j, i)  # R_ij = 1/J at the start
    for t in range(opts.iterations):
        w = r * a  # R'_ij = R_ij a_i  [B, P, J, I]
        alpha, m, inv_psi, kappa, nu, e_ln_lambda = _parameters(contract_w(t, w), w, c, opts)
        e_ln_pi = _e_ln_pi(alpha)  # [B, P, J]
        if t == opts.iterations - 1:
            break
        # E[(V − μ)ᵀ Λ (V − μ)] = D/κ_j + Σ_h (ν_j/Ψ⁻¹_jh) ((V − c)² − 2 (V − c)(m − c) + (m − c)²)_h  [B, P, J, I]
        prec = nu.unsqueeze(-1) / inv_psi  # ν_j / Ψ⁻¹_jh  [B, P, J, D]
        e = m - c
        theta = torch.cat([-2.0 * prec * e, prec], dim=-1)  # [B, P, J, 2D]
        quad = contract_theta(t, theta) + (d / kappa + (prec * e * e).sum(-1)).unsqueeze(-1)
        # ln ρ_ij = E[ln π_j] + ½ E[ln |Λ_j|] − ½ D ln 2π − ½ E[(V − μ)ᵀ Λ (V − μ)]  [B, P, J, I]
        log_rho = (e_ln_pi + 0.5 * e_ln_lambda - 0.5 * d * _LOG_2PI).unsqueeze(-1) - 0.5 * quad
        norm = child_normalizer(log_rho, opts.child_index, opts.n_children)  # ln Σ_{parents of i} ρ  [B, P, 1, I]
        if opts.min_normaliser > 0:
            norm = norm.clamp_min(math.log(opts.min_normaliser))
        r = torch.exp(log_rho - norm)  # R_ij = ρ_ij / max(Σ_{parents of i} ρ, min_normaliser)
    entropy = 0.5 * d * math.log(2.0 * math.pi * math.e) - 0.5 * e_ln_lambda  # H[q(μ_j, Λ_j)]  [B, P, J]
    logits = beta_a.view(1, 1, j) - (torch.exp(e_ln_pi) * entropy + beta_u.view(1, 1, j))  # â_j  [B, P, J]
    return m, logits, r


def _statistics(votes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U = [V − c, (V − c)²] [B, P, J, I, 2D], V − c, c [B, P, J, D]) with c each parent's unweighted mean vote."""
    c = votes.mean(dim=3, keepdim=True)  # [B, P, J, 1, D]
    x = votes - c
    return torch.cat([x, x * x], dim=-1), x, c.squeeze(3)


def _contractions(u: torch.Tensor, qs: list, es: list) -> tuple[Callable, Callable]:
    def contract_w(t, w):  # Σ_i w_ij U_ij, a batched [1, I] @ [I, 2D]
        qs.append((w.unsqueeze(-2) @ u).squeeze(-2))
        return qs[-1]

    def contract_theta(t, theta):  # U_ij · θ_j, a batched [1, 2D] @ [2D, I]
        es.append((theta.unsqueeze(-2) @ u.transpose(-1, -2)).squeeze(-2))
        return es[-1]

    return contract_w, contract_theta


class _VBRouting(torch.autograd.Function):
    """VB routing with a hand-made backward: the small [B, P, J, ...] graph is replayed under autograd with the
    contractions the forward pass saved, and ∂U, the one gradient of U's size, is formed once as Σ_t w_t ⊗ ∂Q_t +
    Σ_t ∂E_t ⊗ θ_t (a batched product of inner size 2r − 1) instead of one outer product per contraction, summed."""

    @staticmethod
    def forward(ctx, votes, a, beta_u, beta_a, opts: _Options):
        u, _, c = _statistics(votes)
        qs: list[torch.Tensor] = []
        es: list[torch.Tensor] = []
        m, logits, r = _vb_loop(*_contractions(u, qs, es), c, a, beta_u, beta_a, opts)
        ctx.opts = opts
        ctx.save_for_backward(u, c, a, beta_u, beta_a, *qs, *es)
        return m, logits, r

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        opts = ctx.opts
        u, c, a, beta_u, beta_a, *saved = ctx.saved_tensors
        qs, es = saved[: opts.iterations], saved[opts.iterations :]
        leaves = [x.detach().requires_grad_() for x in (c, a, beta_u, beta_a)]
        replay = Replayed(u, qs, es)
        with torch.enable_grad():
            c_leaf, a_leaf, bu_leaf, ba_leaf = leaves
            outs = _vb_loop(replay.contract_w, replay.contract_theta, c_leaf, a_leaf, bu_leaf, ba_leaf, opts)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        g_u = replay.grad_u()  # ∂U  [B, P, J, I, 2D]
        d, n_slots = c.shape[-1], u.shape[-2]
        # U = [x, x²] with x = V − c, c = mean_i V: ∂x = ∂U[:D] + 2x ∂U[D:]; ∂V = ∂x − mean_i ∂x + ∂c / I
        g_x = torch.addcmul(g_u[..., :d], u[..., :d], g_u[..., d:], value=2.0)
        g_c = leaves[0].grad if leaves[0].grad is not None else torch.zeros_like(c)
        g_v = g_x - g_x.mean(dim=3, keepdim=True) + (g_c / n_slots).unsqueeze(3)
        return g_v, *[x.grad for x in leaves[1:]], None


def vb_routing(
    votes: torch.Tensor,
    activations: torch.Tensor,
    beta_u: torch.Tensor,
    beta_a: torch.Tensor,
    *,
    iterations: int = 3,
    prior: VBPrior = DEFAULT_PRIOR,
    child_index: torch.Tensor | None = None,
    n_children: int | None = None,
    min_normaliser: float = MIN_NORMALISER,
    fast: bool = True,
) -> VBResult:
    """VB routing of votes V_ij [B, P, J, I, D] weighted by the activations a_i of the child in each slot [B, P, I];
    β_u, β_a [J] (one per parent type). `child_index` [P, I] (long) maps slots to children, for the normalisation of
    R over every parent a child reaches (None: each slot is a distinct child). `min_normaliser`: the floor of
    Σ_j ρ_ij (the authors' 1e-11; 0: none, R_ij sums to 1 over the parents of each child as in the paper). `fast`:
    the hand-made backward (`_VBRouting`); False: plain autograd through the same steps (the same result)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    shape = tuple(votes.shape)
    nu0 = float(shape[-1] + 1) if prior.nu0 is None else prior.nu0
    opts = _Options(shape, iterations, prior, nu0, child_index, n_children, min_normaliser)  # type: ignore[arg-type]
    a = activations.unsqueeze(2)  # a_i  [B, P, 1, I]
    if fast:
        m, logits, r = _VBRouting.apply(votes, a, beta_u, beta_a, opts)
    else:
        u, _, c = _statistics(votes)
        m, logits, r = _vb_loop(*_contractions(u, [], []), c, a, beta_u, beta_a, opts)
    return VBResult(m, logits, r)


class VBNorm(nn.Module):
    """The authors' output normalisation of a VB routing layer: BatchNorm without affine parameters of the poses m_j
    (per parent type, over the batch, the positions and the pose entries: their BatchNorm3d) and of the activation
    logits â_j (per type, over the batch and the positions), then a_j = sigmoid(BN(â_j))."""

    def __init__(self, n_types: int, *, enabled: bool = True):
        super().__init__()
        self.enabled = enabled
        self.poses = nn.BatchNorm1d(n_types, affine=False) if enabled else None
        self.logits = nn.BatchNorm1d(n_types, affine=False) if enabled else None

    def forward(self, res: VBResult) -> tuple[torch.Tensor, torch.Tensor]:
        """VBResult [B, P, J, ...] -> (poses [B, P, J, D], activations a_j [B, P, J])."""
        m, logits = res.poses, res.logits
        if self.poses is None or self.logits is None:
            return m, torch.sigmoid(logits)
        b, p, j, d = m.shape
        m = self.poses(m.permute(0, 2, 3, 1).reshape(b, j, d * p)).view(b, j, d, p).permute(0, 3, 1, 2)
        logits = self.logits(logits.transpose(1, 2)).transpose(1, 2)
        return m, torch.sigmoid(logits)


def routing_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype VB routing runs in: float64 for float64 inputs, else float32 (bf16 under autocast too: the digamma
    functions and the scatter Σ R'V² − R μ̄² need it). The layers route with autocast off."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def xavier_bound(fan_in: int, fan_out: int) -> float:
    """The authors' Xavier-uniform bound for W_ij: √3 · √(2 / (fan_in + fan_out)), fans = types · K² · D."""
    return math.sqrt(3.0) * math.sqrt(2.0 / (fan_in + fan_out))


__all__ = [
    "DEFAULT_PRIOR",
    "MIN_NORMALISER",
    "VBNorm",
    "VBPrior",
    "VBResult",
    "routing_dtype",
    "vb_routing",
    "xavier_bound",
]
