"""Inverted dot-product attention routing (Tsai et al., ICLR 2020) as one fused C++ kernel on CPUs, with its
analytic backward.

The kernel (``csrc/inverted_attention_cpu.cpp``) works one sample at a time, in parallel over the batch: a
sample's votes v_ij = W_ij p_i [in, out, d] stay in the L2 cache while every pass runs on them (agreement, softmax
over the parents and weighted sum fused into one sweep over the votes), and the first pass from p_j = 0 is the
mean vote, summed while the votes are formed. Autograd records one node for all the passes: the backward pass
recomputes the votes and walks the passes backwards keeping only small factors (the gradients of the pre-LayerNorm
sums [B, T, out, d] and of the agreements [T-1, B, in, out]), then, in parallel over the input capsules, forms
dL/du and dL/dW (summed over the batch in a fixed order, so the result does not depend on the thread count).

Matrix poses (√d×√d matrices P_i, W_ij √d×√d) go through the same kernel: V_ij = W_ij P_i costs √d multiply-adds
per vote element, as written, with W_ij passed as √d rows of d (`matrix_weight_rows`; autograd folds their
gradient back onto W).

Built on request by `capsnet.routing.extension`, as dynamic routing's kernel (``capsnet build-kernels``; needs
a C++ compiler and ninja, cached in capsnet's kernel cache; the building blocks both kernels share are in
``csrc/routing_common.h``). Until it is built, `available` is False and the layers use the plain PyTorch
computation;
``CAPSNET_NO_EXT=1`` disables it.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import autocast_off
from .extension import LazyExtension

EXTENSION = LazyExtension(
    "inverted_attention_cpu", what="the fused inverted-attention CPU kernel", fallback="the PyTorch computation"
)
build, load, _kernel = EXTENSION.build, EXTENSION.load, EXTENSION.kernel  # compile now; or None; or error
available, applicable = EXTENSION.checks()  # whether it is used; whether cpu_inverted_attention handles (u, weight)


# ------------------------------------------------------------------------------------------------ custom ops
# `capsnet::inverted_attention_cpu` (forward) and `capsnet::inverted_attention_cpu_backward` (CPU only): one node
# each for autograd and torch.compile.


@torch.library.custom_op("capsnet::inverted_attention_cpu", mutates_args=(), device_types="cpu")
def _forward_op(
    u: torch.Tensor,
    weight: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    parent: torch.Tensor | None,
    passes: int,
    scale: float,
    eps: float,
    matrix: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p [B, out, d], r [B, in, out] of the last pass, r_all [K, B, in, out] of the passes with agreement,
    s_all [B, passes, out, d] the sums before LayerNorm). With `matrix`, weight is `matrix_weight_rows`'s."""
    p0 = None if parent is None else parent.contiguous()
    p, r_all, s_all = _kernel().forward(
        u.contiguous(), weight.contiguous(), gamma.contiguous(), beta.contiguous(), p0, passes, scale, eps, matrix
    )
    if r_all.shape[0]:
        r = r_all[-1].clone()
    else:  # a single pass from p_j = 0 routes uniformly
        r = u.new_full((u.shape[0], weight.shape[0], weight.shape[1]), 1.0 / weight.shape[1])
    return p, r, r_all, s_all


@_forward_op.register_fake
def _(u, weight, gamma, beta, parent, passes, scale, eps, matrix):
    batch, n_in, n_out, d = u.shape[0], weight.shape[0], weight.shape[1], weight.shape[3]
    agreeing = passes if parent is not None else passes - 1
    return (
        u.new_empty(batch, n_out, d),
        u.new_empty(batch, n_in, n_out),
        u.new_empty(agreeing, batch, n_in, n_out),
        u.new_empty(batch, passes, n_out, d),
    )


@torch.library.custom_op("capsnet::inverted_attention_cpu_backward", mutates_args=(), device_types="cpu")
def _backward_op(
    grad_p: torch.Tensor | None,
    grad_r: torch.Tensor | None,
    u: torch.Tensor,
    weight: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    parent: torch.Tensor | None,
    r_all: torch.Tensor,
    s_all: torch.Tensor,
    passes: int,
    scale: float,
    eps: float,
    matrix: bool,
    need_u: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/du, dL/dW, [dL/dγ; dL/dβ] [2, d], dL/dparent); an empty tensor stands for one not needed or absent."""
    p0 = None if parent is None else parent.contiguous()
    du, dw, dgb, dp0 = _kernel().backward(
        grad_p,
        grad_r,
        u.contiguous(),
        weight.contiguous(),
        gamma.contiguous(),
        beta.contiguous(),
        p0,
        r_all,
        s_all,
        passes,
        scale,
        eps,
        matrix,
        need_u,
        need_w,
    )
    empty = u.new_empty(0)
    return (du if need_u else empty), (dw if need_w else empty), dgb.sum(0), (empty if p0 is None else dp0)


@_backward_op.register_fake
def _(grad_p, grad_r, u, weight, gamma, beta, parent, r_all, s_all, passes, scale, eps, matrix, need_u, need_w):
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(u, memory_format=contiguous) if need_u else u.new_empty(0),
        torch.empty_like(weight, memory_format=contiguous) if need_w else u.new_empty(0),
        u.new_empty(2, weight.shape[3]),
        u.new_empty(0) if parent is None else torch.empty_like(parent, memory_format=contiguous),
    )


def _setup_context(ctx, inputs, output) -> None:
    u, weight, gamma, beta, parent, passes, scale, eps, matrix = inputs
    _, _, r_all, s_all = output
    ctx.mark_non_differentiable(r_all, s_all)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(u, weight, gamma, beta, parent, r_all, s_all)
    ctx.passes, ctx.scale, ctx.eps, ctx.matrix = passes, scale, eps, matrix


def _backward(ctx, grad_p, grad_r, *_):
    u, weight, gamma, beta, parent, r_all, s_all = ctx.saved_tensors
    need_u, need_w, need_gamma, need_beta, need_parent = ctx.needs_input_grad[:5]
    if (grad_p is None and grad_r is None) or not any(ctx.needs_input_grad[:5]):
        return (None,) * 9
    du, dw, dgb, dp0 = _backward_op(
        grad_p,
        grad_r,
        u,
        weight,
        gamma,
        beta,
        parent,
        r_all,
        s_all,
        ctx.passes,
        ctx.scale,
        ctx.eps,
        ctx.matrix,
        need_u,
        need_w,
    )
    return (
        du if need_u else None,
        dw if need_w else None,
        dgb[0] if need_gamma else None,
        dgb[1] if need_beta else None,
        dp0 if need_parent and parent is not None else None,
        None,
        None,
        None,
        None,
    )


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def matrix_weight_rows(weight: torch.Tensor) -> torch.Tensor:
    """W [I, J, S, S] of S×S matrix poses -> the kernel's rows [I, J, S, S²]: V[r, c] = Σ_k W[r, k] P[k, c] is
    Σ_k rows[k, (r, c)] P[k, c] with rows[k, (r, c)] = W[r, k] (autograd sums the gradient back over c)."""
    n_in, n_out, side, _ = weight.shape
    rows = weight.transpose(-1, -2).unsqueeze(-1).expand(n_in, n_out, side, side, side)
    return rows.reshape(n_in, n_out, side, side * side)


def cpu_inverted_attention(
    u: torch.Tensor,
    weight: torch.Tensor,
    norm: nn.LayerNorm,
    parent: torch.Tensor | None,
    passes: int,
    *,
    scale: float = 1.0,
    matrix_pose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`passes` passes of Procedure 1 (Tsai et al.) from the parents' poses `parent` [N, out, d] (None: p_j = 0)
    by the fused kernel, votes included. u [N, in, d_in], W [in, out, d_in, d_out] (or [in, out, √d, √d] with
    matrix_pose). Returns the new poses [N, out, d] and the last pass's routing coefficients r [N, in, out].

    float64 inputs are routed in float64, anything else (e.g. bf16 under autocast) in float32. Differentiable once.
    """
    if norm.weight is None or norm.bias is None:
        raise ValueError("cpu_inverted_attention needs a LayerNorm with elementwise affine parameters")
    dtype = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    with autocast_off("cpu"):
        w = weight.to(dtype)
        w = matrix_weight_rows(w) if matrix_pose else w
        p0 = None if parent is None else parent.to(dtype)
        p, r, _, _ = _forward_op(
            u.to(dtype),
            w,
            norm.weight.to(dtype),
            norm.bias.to(dtype),
            p0,
            passes,
            float(scale),
            float(norm.eps),
            matrix_pose,
        )
    return p, r
