"""Dynamic routing between capsules (Procedure 1): the `Router` layer and the plain autograd reference path.

Symbols follow Sabour, Frosst & Hinton (2017), "Dynamic Routing Between Capsules":
  u_i      output of lower-level (input) capsule i                  [B, in_caps, in_d]
  W_ij     transformation matrix from capsule i to capsule j        [in_caps, out_caps, in_d, out_d]
  û_j|i    prediction ("vote") of capsule i for capsule j, W_ij u_i [B, in_caps, out_caps, out_d]
  b_ij     routing logits, c_ij = softmax_j(b_ij) coupling coeffs.  [B, in_caps, out_caps]
  s_j      total input of capsule j, v_j = squash(s_j) its output   [B, out_caps, out_d]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.squash import squash
from . import dynamic_cpu as routing_cpu
from . import dynamic_triton as routing_triton
from .backend import KernelLayer
from .base import RoutingOutput
from .dynamic_fast import fast_dynamic_routing


class RoutingResult(NamedTuple):
    """Output capsules v [B, out_caps, out_d] and the final coupling coefficients c [B, in_caps, out_caps]."""

    capsules: torch.Tensor
    coupling: torch.Tensor


BIAS_INIT = 0.1  # the official code's initial capsule bias (research/capsules, `bias_variable`)


def default_weight_std(in_caps: int) -> float:
    """Initial std of W_ij: 1 / sqrt(in_caps), a fan-in rule over the input capsules (0.0295 for MNIST's 1152).

    With the first pass's uniform coupling c_ij = 1/out_caps, s_j sums in_caps independent votes, each of norm
    about std·sqrt(out_d)·|u_i|, so std = 1/sqrt(in_caps) makes |s_j| ≈ sqrt(out_d)·|u_i| / out_caps whatever
    the number of input capsules: small, in the squash's linear-to-quadratic range, never saturated (measured
    against larger stds: docs/benchmarks.md#accuracy-on-the-bundled-sample).
    """
    return 1.0 / math.sqrt(in_caps)


def coherent_vote_lr(lr: float, *, in_caps: int, out_caps: int, reference: tuple[int, int]) -> float:
    """Adam's learning rate for a dynamic-routing class layer of in_caps -> out_caps, from `lr`, the rate a paper
    trained its own layer of reference = (in_caps, out_caps) with: lr × min(1, (N_ref / J_ref) / (N / J)).

    Eq. 2: s_j = Σ_i c_ij û_j|i with c_ij ≈ 1/J at first, so s_j grows with the N/J votes that agree. Adam moves every
    W_ij by about lr per step whatever its gradient, so after a few steps of votes that agree (an easy class of one's
    own data) |s_j| grows N/J-fold faster than in the paper's layer. Where N/J is far above the paper's (CapsNet
    at 32×32 RGB with 3 classes: 2,048 / 3 = 683 against MNIST's 1,152 / 10 = 115), every |s_j| reaches the
    squash's flat end within the first epoch, where |v_j| ≈ 1 for every class and the margin loss's gradient
    through Eq. 1 falls as 1/|s_j|³: training stops at chance (docs/fidelity.md, "Learning rate and the number
    of votes"). Scaling lr by the ratio keeps the per-step change of |s_j| the paper's; at the paper's N/J or
    below it is the paper's lr unchanged.
    """
    ratio = (reference[0] / reference[1]) / (in_caps / out_caps)
    return lr * min(1.0, ratio)


class Router(KernelLayer, nn.Module):
    """Dynamic routing between capsules (Procedure 1 of the paper), as a drop-in layer.

    Args:
        in_caps, out_caps: number of input (lower-level) and output (higher-level) capsules.
        in_d, out_d: their dimensions.
        iterations: routing iterations r ≥ 1 (the paper uses 3).
        detach_votes: stop gradients through û_j|i in every iteration but the last (a common variant;
            the paper's default, False, backpropagates through all of them).
        weight_std: initial std of W; defaults to `default_weight_std`.
        leaky: the paper's §7 "none-of-the-above" routing (its CIFAR-10 model): an extra logit of zero joins the
            softmax over the output capsules, so an input capsule can send part of its vote nowhere; that share is
            dropped afterwards (the official code's `_leaky_routing`).
        bias: a learned bias per output capsule [out_caps, out_d], added to s_j before the squash in every
            iteration (the official code's capsule layers have one, initialised to 0.1; the paper does not
            mention it).
        coupling: the axis of Eq. 3's softmax: "outputs" (the paper: each input capsule's c_ij sum to 1 over the
            outputs j) or "inputs" (over the input capsules i, as gram-ai/capsule-networks computes it; for
            their converted weights). "inputs" runs the plain autograd path.
        fast: use a fast path with a hand-derived backward (fp32 under autocast) instead of the plain autograd
            path (`route_votes` + `dynamic_routing`): on CPUs the fused C++ kernel of
            `capsnet.routing.dynamic_cpu` (once built: ``capsnet build-kernels``; ``CAPSNET_NO_EXT=1`` disables
            it); on CUDA under the "triton" backend, the Triton kernels of `capsnet.routing.dynamic_triton`;
            elsewhere, or until it is built, `capsnet.routing.fast_dynamic_routing` (large-K GEMMs). All
            compute the same function; the fast ones support a single backward pass only, so set
            ``router.fast = False`` for double backward (e.g. gradient penalties). `router.backend` ("auto", "cpp",
            "torch", "triton"; None: the global choice of `capsnet.routing.set_backend`) decides between the
            kernels and the GEMM path.

    `weight` has the layout of labml's reference code (in_caps, out_caps, in_d, out_d), so its state dicts load
    unchanged.
    """

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int,
        iterations: int = 3,
        *,
        detach_votes: bool = False,
        weight_std: float | None = None,
        fast: bool = True,
        leaky: bool = False,
        bias: bool = False,
        coupling: str = "outputs",
    ):
        super().__init__()
        if coupling not in ("outputs", "inputs"):
            raise ValueError(f"Router: coupling must be 'outputs' or 'inputs', got {coupling!r}")
        if coupling == "inputs" and leaky:
            raise ValueError("Router: leaky routing is a softmax over the outputs (coupling='outputs')")
        if min(in_caps, out_caps, in_d, out_d) < 1:
            raise ValueError("Router: in_caps, out_caps, in_d and out_d must all be >= 1")
        if iterations < 1:
            raise ValueError(f"Router: iterations must be >= 1, got {iterations}")
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.iterations = iterations
        self.detach_votes = detach_votes
        self.fast = fast
        self.chunk: int | None = None  # batch chunk of the fast path; None: capsnet.routing.default_chunk
        self.weight = nn.Parameter(torch.empty(in_caps, out_caps, in_d, out_d))
        self.weight_std = default_weight_std(in_caps) if weight_std is None else weight_std
        self.leaky, self.coupling = leaky, coupling
        self.bias = nn.Parameter(torch.empty(out_caps, out_d)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.weight_std)
        if self.bias is not None:
            nn.init.constant_(self.bias, BIAS_INIT)

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"iterations={self.iterations}, detach_votes={self.detach_votes}"
            + (", leaky=True" if self.leaky else "")
            + (", bias=True" if self.bias is not None else "")
            + (f", coupling={self.coupling!r}" if self.coupling != "outputs" else "")
        )

    def _check_input(self, u: torch.Tensor) -> None:
        expected = f"[B, {self.in_caps}, {self.in_d}]"
        if not isinstance(u, torch.Tensor):
            raise ValueError(f"Router expects a tensor of shape {expected}, got {type(u).__name__}")
        if u.dim() != 3 or u.shape[1] != self.in_caps or u.shape[2] != self.in_d:
            raise ValueError(f"Router expects input of shape {expected}, got {list(u.shape)}")
        if not u.is_floating_point():
            raise ValueError(f"Router expects a floating-point input of shape {expected}, got dtype {u.dtype}")

    def votes(self, u: torch.Tensor) -> torch.Tensor:
        """Eq. 2: û_j|i = W_ij u_i   [B, in_caps, out_caps, out_d]."""
        return route_votes(self.weight, u)

    def forward(
        self,
        u: torch.Tensor,
        a: torch.Tensor | None = None,
        *,
        return_coupling: bool = False,
        return_weights: bool = False,
    ) -> torch.Tensor | RoutingResult | RoutingOutput:
        """u [B, in_caps, in_d] -> v [B, out_caps, out_d]. `return_coupling=True` gives labml's
        RoutingResult(v, c); `return_weights=True` the RoutingOutput(v, c) every routing layer returns.
        Dynamic routing has no input activations: `a` must be None."""
        self._check_input(u)
        if a is not None:
            raise ValueError("Router (dynamic routing) takes no input activations (pass a=None)")
        # The fused CPU kernel implements plain Procedure 1; the GEMM path also leaky routing and the bias (but not
        # a bias with detach_votes: that takes the reference path, which materializes the votes [B, in, out, out_d]).
        plain = not self.leaky and self.bias is None
        fast = self.fast and not (self.bias is not None and self.detach_votes) and self.coupling == "outputs"
        if fast and plain and routing_cpu.applicable(u, self.weight, self.backend):
            v, c = routing_cpu.cpu_dynamic_routing(u, self.weight, self.iterations, detach_votes=self.detach_votes)
        elif fast and plain and routing_triton.applicable(u, self.weight, self.backend):  # CUDA, backend triton
            v, c = routing_triton.triton_dynamic_routing(
                u, self.weight, self.iterations, detach_votes=self.detach_votes
            )
        elif fast:
            v, c = fast_dynamic_routing(
                u,
                self.weight,
                self.iterations,
                detach_votes=self.detach_votes,
                chunk=self.chunk,
                leaky=self.leaky,
                bias=self.bias,
            )
        else:
            v, c = dynamic_routing(
                self.votes(u),
                self.iterations,
                detach_votes=self.detach_votes,
                leaky=self.leaky,
                bias=self.bias,
                coupling=self.coupling,
            )
        if return_weights:
            return RoutingOutput(v, c)
        return RoutingResult(v, c) if return_coupling else v


def route_votes(weight: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """û_j|i = W_ij u_i for all i, j as one batched matmul over i.  W [I, J, N, M], u [B, I, N] -> [B, I, J, M]."""
    n_in, n_out, d_in, d_out = weight.shape
    w = weight.permute(0, 2, 1, 3).reshape(n_in, d_in, n_out * d_out)  # [I, N, J·M]
    u_hat = torch.bmm(u.transpose(0, 1), w.to(u.dtype))  # [I, B, J·M]
    return u_hat.view(n_in, -1, n_out, d_out).transpose(0, 1)  # [B, I, J, M]


def dynamic_routing(
    u_hat: torch.Tensor,
    iterations: int,
    *,
    detach_votes: bool = False,
    leaky: bool = False,
    bias: torch.Tensor | None = None,
    coupling: str = "outputs",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Procedure 1 on precomputed votes û [B, in, out, out_d]. Returns v [B, out, out_d] and the final c.

    `leaky`: §7's extra zero logit in the softmax over the outputs (its share dropped); `bias` [out, out_d]: added to
    s_j before the squash; `coupling="inputs"`: the softmax runs over the input capsules (see `Router`)."""
    batch, n_in, n_out, _ = u_hat.shape
    u_hat_routing = u_hat.detach() if detach_votes else u_hat
    b = u_hat.new_zeros(batch, n_in, n_out)  # b_ij ← 0  [B, in, out]
    for r in range(iterations):
        last = r == iterations - 1
        votes = u_hat if last else u_hat_routing
        c = leaky_softmax(b) if leaky else F.softmax(b, dim=2 if coupling == "outputs" else 1)  # Eq. 3  [B, in, out]
        s = torch.einsum("bij,bijm->bjm", c, votes)  # s_j = Σ_i c_ij û_j|i  [B, out, out_d]
        if bias is not None:
            s = s + bias.to(s.dtype)  # the official code's per-capsule bias  [B, out, out_d]
        v = squash(s)  # Eq. 1  [B, out, out_d]
        if not last:  # the update after the last pass would never be used
            b = b + torch.einsum("bjm,bijm->bij", v, votes)  # b_ij ← b_ij + û_j|i · v_j
    return v, c


def leaky_softmax(b: torch.Tensor) -> torch.Tensor:
    """§7 "none-of-the-above": softmax over the outputs (last dim) with an extra logit 0, whose share is dropped.

    c_ij = exp(b_ij) / (1 + Σ_k exp(b_ik))   b [..., out] -> c [..., out], Σ_j c_ij < 1."""
    padded = torch.cat([b, b.new_zeros(*b.shape[:-1], 1)], dim=-1)
    return F.softmax(padded, dim=-1)[..., :-1]
