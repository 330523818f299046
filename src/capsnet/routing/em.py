"""EM routing between matrix capsules (Hinton, Sabour & Frosst, ICLR 2018, "Matrix capsules with EM routing",
Procedure 1), vectorised over the batch, the parent positions and the children in each parent's receptive field.

Each child capsule i has a 4×4 pose M_i and an activation a_i; it votes V_ij = M_i W_ij for each parent j it
reaches. Each parent j is a Gaussian over the 16 vote components; EM fits the mixture:

- M-step (per parent j):  R'_ij = R_ij a_i;  μ_jh = Σ_i R'_ij V_ijh / Σ_i R'_ij;
  σ²_jh = Σ_i R'_ij (V_ijh − μ_jh)² / Σ_i R'_ij;  cost_jh = (β_u + log σ_jh) Σ_i R'_ij;
  a_j = sigmoid(λ (β_a − Σ_h cost_jh)).
- E-step (per child i):  log p_ij = −Σ_h (V_ijh − μ_jh)² / (2σ²_jh) − ½ Σ_h log(2π σ²_jh);
  R_ij = a_j p_ij / Σ_{j' ∈ parents(i)} a_j' p_ij'  (in the log domain, a logsumexp over the parents i reaches).

Choices beyond the paper's text, each cited:

- λ (inverse temperature) per iteration t = 0, 1, 2: λ_t = λ_final (1 − 0.95^(t+1)), λ_final = 0.01 — the formula
  the authors gave on OpenReview (quoted in Gritzman 2019's code), the same form as `final_beta` in the official
  `capsule_em` code (google-research). It does not change over training.
- Gritzman 2019 ("Avoiding implementation pitfalls of matrix capsule networks with EM routing"):
  - *normalising the amount of data assigned to each parent*: Σ_i R'_ij in the cost is scaled by 100 J / I (I =
    children in a parent's field, J = parent types), so λ and β keep one meaning whether a parent sees 9·32
    children (ConvCaps) or 4·4·32 (ClassCaps);
  - *competition across positions*: a child in several overlapping fields is one data point; its R is normalised
    over every parent it reaches, at all positions (`child_index`), not over the types at each position alone;
  - *parents with one child* and σ → 0: σ² has a floor (`min_var`) so log σ and 1/σ² stay finite, and σ is never
    taken by a square root (its gradient is infinite at 0): log σ = ½ log σ².
- The floor `min_var` defaults to 5e-4, the official `capsule_em` code's `min_var`; the gradient through the E-step
  grows as 1/σ², and `capsnet.models.EMCapsNet` uses 1e-2 (measured: docs/benchmarks.md).
- The last iteration's E-step is skipped (it changes neither μ nor a); the returned R is the one the final M-step
  used.

Speed. The Gaussian is an exponential family with sufficient statistics (V, V²), so both steps are contractions
of one stacked tensor U = [V − c, (V − c)²]  [B, P, J, I, 32] built once (c: the unweighted mean vote of each
parent, subtracted so that E[V²] − μ² does not cancel catastrophically):
M-step: Σ_i R'_ij U_ij (a batched [1, I] @ [I, 32]); E-step: U_ij · θ_j with natural parameters
θ_j = [μ_j/σ²_j, −1/(2σ²_j)] (a batched [1, 32] @ [32, I]). No [B, P, J, I, 16] tensor is made per iteration.
ConvCaps does not hand over its votes: `capsnet.routing.em_conv` forms them inside, a few images at a time.

Shapes: B batch, P parent positions, J parent types, I children in a parent's receptive field (slots), h the 16
pose components.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..configs.base import FINAL_LAMBDA as FINAL_LAMBDA
from .base import autocast_off

MIN_VAR = 5e-4  # σ² floor: `min_var` of the official capsule_em code
DATA_SCALE = 100.0  # Gritzman 2019: Σ_i R'_ij × 100 / (I / J)
_LOG_2PI = math.log(2.0 * math.pi)
_TINY = 1e-8  # added to Σ_i R'_ij, so a parent that no active child reaches gets μ = c, σ² = min_var


class EMResult(NamedTuple):
    poses: torch.Tensor  # μ_j, the parents' poses  [B, P, J, 16]
    activations: torch.Tensor  # a_j  [B, P, J]
    logits: torch.Tensor  # λ (β_a − Σ_h cost_jh), so a_j = sigmoid(logits)  [B, P, J]
    assignments: torch.Tensor  # R_ij used by the final M-step  [B, P, J, I]


def inverse_temperature(t: int, final_lambda: float = FINAL_LAMBDA) -> float:
    """λ at routing iteration t (0-based): λ_final (1 − 0.95^(t+1))."""
    return final_lambda * (1.0 - 0.95 ** (t + 1))


def child_normalizer(z: torch.Tensor, child_index: torch.Tensor | None, n_children: int | None) -> torch.Tensor:
    """log Σ_{j ∈ parents(i)} exp(z_ij) for each slot's child i, broadcastable against z  [B, P, 1, I].

    z [B, P, J, I]. `child_index` [P, I] names the child in each slot (None: every slot is its own child, so the
    sum runs over the J types at that position only)."""
    s = torch.logsumexp(z, dim=2)  # over the parent types at one position  [B, P, I]
    if child_index is None:
        return s.unsqueeze(2)
    assert n_children is not None  # given with child_index
    b = s.shape[0]
    flat = s.reshape(b, -1)  # [B, P·I]
    idx = child_index.reshape(1, -1).expand(b, -1)
    with torch.no_grad():  # a per-child maximum keeps exp() in range; the result does not depend on it
        m = flat.new_full((b, n_children), -torch.inf).scatter_reduce(1, idx, flat, reduce="amax")
        m = torch.nan_to_num(m, neginf=0.0)  # children in no field
    total = flat.new_zeros(b, n_children).scatter_add(1, idx, torch.exp(flat - m.gather(1, idx)))
    lse = m + torch.log(total)  # log Σ over every parent of child i, all positions  [B, n_children]
    return lse.gather(1, idx).view(b, s.shape[1], 1, s.shape[2])


def initial_log_assignments(
    shape: tuple[int, int, int, int], child_index: torch.Tensor | None, n_children: int | None, like: torch.Tensor
) -> torch.Tensor:
    """log R_ij at the start: uniform over the parents each child reaches, −log(J · #positions reaching i)."""
    _, p, j, i = shape
    if child_index is None:
        return like.new_full((1, 1, 1, 1), -math.log(j))
    assert n_children is not None  # given with child_index
    reach = torch.bincount(child_index.reshape(-1), minlength=n_children).to(like.dtype)  # [n_children]
    return -torch.log(j * reach[child_index]).view(1, p, 1, i)


def _em_loop(contract_w, contract_theta, a_in, beta_u, beta_a, log_r, opts: _Options):
    """Procedure 1 on the small tensors; the two contractions with U come from the caller (computed in the forward
    pass, replayed in the backward pass). Returns (μ − c [B, P, J, 16], logits [B, P, J], R [B, P, J, I])."""
    bsz, p, j, i, h = opts.shape
    bu, ba = beta_u.view(1, 1, j, 1), beta_a.view(1, 1, j)
    data_scale = DATA_SCALE * j / i  # Gritzman 2019: normalise the data assigned to each parent
    for t in range(opts.iterations):
        lam = inverse_temperature(t, opts.final_lambda)
        # ---- M-step: R'_ij = R_ij a_i  [B, P, J, I]
        r = torch.exp(log_r).expand(bsz, p, j, i)
        w = r * a_in
        mass = w.sum(dim=3) + _TINY  # Σ_i R'_ij  [B, P, J]
        stats = contract_w(t, w) / mass.unsqueeze(-1)  # [E(V − c), E(V − c)²]  [B, P, J, 32]
        mu_c = stats[..., :h]  # μ_jh − c_jh  [B, P, J, 16]
        var = (stats[..., h:] - mu_c * mu_c).clamp_min(0.0) + opts.min_var  # σ²_jh, floored  [B, P, J, 16]
        log_var = torch.log(var)
        # cost_h = (β_u + log σ_h) Σ_i R'_ij, with log σ_h = ½ log σ²_h  [B, P, J, 16]
        cost = (bu + 0.5 * log_var) * (mass * data_scale).unsqueeze(-1)
        logits = lam * (ba - cost.sum(dim=-1))  # λ (β_a − Σ_h cost_h)  [B, P, J]
        if t == opts.iterations - 1:
            return mu_c, logits, r
        # ---- E-step: log p_ij = U_ij · θ_j + const_j with θ_j = [μ/σ², −1/(2σ²)]  [B, P, J, I]
        inv_var = 1.0 / var
        theta = torch.cat([mu_c * inv_var, -0.5 * inv_var], dim=-1)  # [B, P, J, 32]
        const = -0.5 * (mu_c * mu_c * inv_var + log_var + _LOG_2PI).sum(dim=-1)  # [B, P, J]
        log_p = contract_theta(t, theta) + const.unsqueeze(-1)
        z = F.logsigmoid(logits).unsqueeze(-1) + log_p  # log a_j + log p_ij
        log_r = z - child_normalizer(z, opts.child_index, opts.n_children)  # R_ij = a_j p_ij / Σ_{parents of i}
    raise AssertionError("unreachable")


class _Options(NamedTuple):
    shape: tuple[int, int, int, int, int]
    iterations: int
    final_lambda: float
    min_var: float
    child_index: torch.Tensor | None
    n_children: int | None


def _contract_w(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """M-step: Σ_i R'_ij U_ij, a batched [1, I] @ [I, 32]  [B, P, J, 32]."""
    return (w.unsqueeze(3) @ u).squeeze(3)


def _contract_theta(u: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """E-step: U_ij · θ_j, written as a batched [1, 32] @ [32, I] (the [I, 32] @ [32, 1] form is ~3× slower on CPU)
    [B, P, J, I]."""
    return (theta.unsqueeze(3) @ u.transpose(-1, -2)).squeeze(3)


class _Replay(torch.autograd.Function):
    """In the backward pass: returns a contraction with U saved by the forward pass; its backward gives the
    gradient for the small operand (one read of U) and stores the incoming gradient for the single ∂U contraction."""

    @staticmethod
    def forward(ctx, x, value, u, store, t, kind):
        ctx.u, ctx.store, ctx.t, ctx.kind = u, store, t, kind
        return value.view_as(value)

    @staticmethod
    def backward(ctx, g):
        ctx.store[ctx.t] = g
        # Q = w U: ∂w = g Uᵀ (a [1, 32] @ [32, I]);  E = U θ: ∂θ = g U (a [1, I] @ [I, 32])
        u = ctx.u.transpose(-1, -2) if ctx.kind == "w" else ctx.u
        return (g.unsqueeze(3) @ u).squeeze(3), None, None, None, None, None


def _route(u, a_in, beta_u, beta_a, opts: _Options):
    """Procedure 1 on U = [V − c, (V − c)²]  [B, P, J, I, 32]: (μ − c, logits, R, the M- and E-step contractions)."""
    qs: list[torch.Tensor] = []
    es: list[torch.Tensor] = []

    def contract_w(t, w):
        qs.append(_contract_w(u, w))
        return qs[-1]

    def contract_theta(t, theta):
        es.append(_contract_theta(u, theta))
        return es[-1]

    log_r = initial_log_assignments(opts.shape[:4], opts.child_index, opts.n_children, u)
    mu_c, logits, r = _em_loop(contract_w, contract_theta, a_in, beta_u, beta_a, log_r, opts)
    return mu_c, logits, r, qs, es


class Replayed:
    """The saved contractions replayed in a backward pass: `contract_w(t, w)` and `contract_theta(t, θ)` return the
    forward's Q_t and E_t through `_Replay`, keeping the small operands; once autograd has run, `grad_u` forms
    ∂U = Σ_t w_t ⊗ ∂Q_t + Σ_t ∂E_t ⊗ θ_t  [B, P, J, I, 2D] in one batched product of inner size 2r − 1, instead of
    autograd's one ∂U per contraction summed. (EM routing's backward and VB routing's share it.)"""

    def __init__(self, u: torch.Tensor, qs: list[torch.Tensor], es: list[torch.Tensor]):
        self.u, self.qs, self.es = u, qs, es
        self.ws: list[torch.Tensor] = []
        self.thetas: list[torch.Tensor] = []
        self.g_q: dict[int, torch.Tensor] = {}
        self.g_e: dict[int, torch.Tensor] = {}

    def contract_w(self, t: int, w: torch.Tensor) -> torch.Tensor:
        self.ws.append(w.detach())
        return _Replay.apply(w, self.qs[t], self.u, self.g_q, t, "w")

    def contract_theta(self, t: int, theta: torch.Tensor) -> torch.Tensor:
        self.thetas.append(theta.detach())
        return _Replay.apply(theta, self.es[t], self.u, self.g_e, t, "theta")

    def grad_u(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """∂U  [B, P, J, I, 2D] (into `out` where given)."""
        zeros_q, zeros_e = torch.zeros_like(self.qs[0]), torch.zeros_like(self.ws[0])
        left = torch.stack(self.ws + [self.g_e.get(t, zeros_e) for t in range(len(self.thetas))], dim=-2)
        right = torch.stack([self.g_q.get(t, zeros_q) for t in range(len(self.ws))] + self.thetas, dim=-2)
        k, (i, n) = left.shape[-2], self.u.shape[-2:]  # left [B, P, J, 2r−1, I], right [B, P, J, 2r−1, 2D]
        if out is None:
            out = self.u.new_empty(self.u.shape)
        torch.bmm(left.view(-1, k, i).transpose(1, 2), right.view(-1, k, n), out=out.view(-1, i, n))  # leftᵀ @ right
        return out


def _route_backward(u, leaves, qs, es, grads, opts: _Options, out: torch.Tensor | None = None) -> torch.Tensor:
    """The backward pass of `_route`: replays the small [B, P, J, I] graph under autograd with the saved
    contractions (the gradients of `leaves` = (a, β_u, β_a) accumulate in their .grad) and returns ∂U
    [B, P, J, I, 32] (`Replayed.grad_u`, into `out` where given)."""
    replay = Replayed(u, qs, es)
    with torch.enable_grad():
        log_r = initial_log_assignments(opts.shape[:4], opts.child_index, opts.n_children, u)
        a_leaf, beta_u_leaf, beta_a_leaf = leaves
        mu_c, logits, r = _em_loop(
            replay.contract_w, replay.contract_theta, a_leaf, beta_u_leaf, beta_a_leaf, log_r, opts
        )
        outs = [(mu_c, grads[0]), (torch.sigmoid(logits), grads[1]), (logits, grads[2]), (r, grads[3])]
        outs = [(o, g) for o, g in outs if g is not None and o.requires_grad]
        if outs:
            torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return replay.grad_u(out)


class _EMRouting(torch.autograd.Function):
    """EM routing on given votes, with a hand-made outer backward (`_route_backward`)."""

    @staticmethod
    def forward(ctx, votes, a_in, beta_u, beta_a, opts: _Options):
        h = opts.shape[-1]
        # Centre on each parent's unweighted mean vote (a constant: every output is invariant to the shift c).
        c = votes.mean(dim=3, keepdim=True)  # [B, P, J, 1, 16] (or [.., 4, 4])
        u = votes.new_empty(*opts.shape[:4], 2 * h)  # sufficient statistics [V − c, (V − c)²]  [B, P, J, I, 32]
        torch.sub(votes, c, out=u[..., :h].view(votes.shape))
        torch.mul(u[..., :h], u[..., :h], out=u[..., h:])
        mu_c, logits, r, qs, es = _route(u, a_in, beta_u, beta_a, opts)
        ctx.opts, ctx.votes_shape = opts, votes.shape
        ctx.save_for_backward(u, a_in, beta_u, beta_a, *qs, *es)
        poses = mu_c + c.reshape(*opts.shape[:3], h)  # μ_j  [B, P, J, 16]
        return poses, torch.sigmoid(logits), logits, r

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        opts = ctx.opts
        u, a_in, beta_u, beta_a, *saved = ctx.saved_tensors
        qs, es = saved[: opts.iterations], saved[opts.iterations :]
        leaves = [x.detach().requires_grad_(need) for x, need in zip((a_in, beta_u, beta_a), ctx.needs_input_grad[1:4])]
        g_u = _route_backward(u, leaves, qs, es, grads, opts)
        h = opts.shape[-1]
        # U = [x, x²] with x = V − c: ∂V = ∂U[:h] + 2 x ∂U[h:]   (c is a constant, see above)
        g_v = torch.addcmul(g_u[..., :h], u[..., :h], g_u[..., h:], value=2.0)
        return g_v.reshape(ctx.votes_shape), *[x.grad if x.requires_grad else None for x in leaves], None


def em_routing(
    votes: torch.Tensor,
    activations: torch.Tensor,
    beta_u: torch.Tensor,
    beta_a: torch.Tensor,
    *,
    iterations: int = 3,
    final_lambda: float = FINAL_LAMBDA,
    child_index: torch.Tensor | None = None,
    n_children: int | None = None,
    min_var: float = MIN_VAR,
) -> EMResult:
    """Procedure 1 of the paper.

    votes V_ij [B, P, J, I, 16] (or [B, P, J, I, 4, 4]); activations a_i of the child in each slot [B, P, I];
    β_u, β_a [J] (one per parent type, shared across positions); `child_index` [P, I] (long) maps slots to children
    for the E-step's normalisation over all parents a child reaches (None: each slot is a distinct child)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    bsz, p, j, i = votes.shape[:4]
    opts = _Options((bsz, p, j, i, 16), iterations, final_lambda, min_var, child_index, n_children)
    dtype = routing_dtype(votes)
    with autocast_off(votes.device.type):
        a_in = activations.to(dtype).unsqueeze(2)  # a_i  [B, P, 1, I]
        poses, acts, logits, r = _EMRouting.apply(votes.to(dtype), a_in, beta_u, beta_a, opts)
    return EMResult(poses, acts, logits, r)


def routing_dtype(x: torch.Tensor) -> torch.dtype:
    """EM runs in float64 for float64 inputs and in float32 for anything else (e.g. bf16 under autocast): the
    variances σ² and log σ² of Procedure 1 lose every digit in bf16."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
