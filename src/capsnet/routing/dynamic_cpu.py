"""Dynamic routing (Procedure 1) as one fused C++ kernel on CPUs, forward and backward.

The kernel (``csrc/routing_cpu.cpp``) works one sample at a time, in parallel over the batch: a sample's votes
û_j|i = W_ijᵀ u_i [in, out, out_d] (737 KB fp32 for MNIST) stay in the L2 cache while all r routing passes run
on them, so routing costs a few MFLOP per sample instead of a sequence of memory-bound tensor ops. The backward
pass is the hand derivation of `capsnet.routing.FastRouting`: per sample it recomputes û and walks the
passes backwards, keeping only small factors (G_t = dL/db_t [in, out], ds_t, v_t [out, out_d]); then, in
parallel over the input capsules, it rebuilds dL/dû from them and forms dL/du and dL/dW, summing over the batch in
a fixed order (so dL/dW does not depend on the number of threads).

The extension is compiled on request by `capsnet.routing.extension` (``capsnet build-kernels``, or the "cpp"
backend; ``-O3 -march=native -fopenmp``; needs a C++ compiler and ninja) and cached in capsnet's kernel cache. Until
it is built, `available` is False and `capsnet.Router` uses
`capsnet.routing.fast_dynamic_routing`.
``CAPSNET_NO_EXT=1`` disables the extension.
"""

from __future__ import annotations

import torch

from .base import autocast_off
from .extension import LazyExtension

EXTENSION = LazyExtension("routing_cpu", what="the fused CPU routing kernel", fallback="the PyTorch-op fast path")
build, load, _kernel = EXTENSION.build, EXTENSION.load, EXTENSION.kernel  # compile now; or None; or error
available, applicable = EXTENSION.checks()  # whether it is used; whether cpu_dynamic_routing handles (u, weight)


# ------------------------------------------------------------------------------------------------ custom ops
# The kernel's forward and backward are the operators `capsnet::routing_cpu` and `capsnet::routing_cpu_backward`
# (CPU only), so torch.compile keeps each as one node; see capsnet.routing.dynamic_fast for the conventions.


@torch.library.custom_op("capsnet::routing_cpu", mutates_args=(), device_types="cpu")
def _routing_cpu_op(
    u: torch.Tensor, weight: torch.Tensor, iterations: int, detach_votes: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v [B, out, out_d], c [B, in, out], c_all [r-1, B, in, out], s_all [B, r, out, out_d], and private
    contiguous copies of u and W for the backward pass); detach_votes matters to the backward pass only."""
    u_c = torch.empty_like(u, memory_format=torch.contiguous_format).copy_(u)
    w_c = torch.empty_like(weight, memory_format=torch.contiguous_format).copy_(weight)
    v, c_all, s_all = _kernel().forward(u_c, w_c, iterations)
    if iterations > 1:
        c = c_all[-1].clone()
    else:  # the single pass couples uniformly
        c = u.new_full((u.shape[0], weight.shape[0], weight.shape[1]), 1.0 / weight.shape[1])
    return v, c, c_all, s_all, u_c, w_c


@_routing_cpu_op.register_fake
def _(u, weight, iterations, detach_votes):
    batch, n_in, _ = u.shape
    _, n_out, _, d_out = weight.shape
    return (
        u.new_empty(batch, n_out, d_out),
        u.new_empty(batch, n_in, n_out),
        u.new_empty(iterations - 1, batch, n_in, n_out),
        u.new_empty(batch, iterations, n_out, d_out),
        torch.empty_like(u, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op("capsnet::routing_cpu_backward", mutates_args=(), device_types="cpu")
def _routing_cpu_backward_op(
    grad_v: torch.Tensor | None,
    grad_c: torch.Tensor | None,
    u: torch.Tensor,
    weight: torch.Tensor,
    c_all: torch.Tensor,
    s_all: torch.Tensor,
    iterations: int,
    detach_votes: bool,
    need_u: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/du [B, in, in_d], dL/dW [in, out, in_d, out_d]), both contiguous; an empty tensor stands for a gradient
    that is not needed."""
    grad_u, grad_w = _kernel().backward(
        grad_v, grad_c, u, weight, c_all, s_all, iterations, detach_votes, need_u, need_w
    )
    return (grad_u if need_u else u.new_empty(0)), (grad_w if need_w else weight.new_empty(0))


@_routing_cpu_backward_op.register_fake
def _(grad_v, grad_c, u, weight, c_all, s_all, iterations, detach_votes, need_u, need_w):
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(u, memory_format=contiguous) if need_u else u.new_empty(0),
        torch.empty_like(weight, memory_format=contiguous) if need_w else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output) -> None:
    _, _, iterations, detach_votes = inputs
    _, _, c_all, s_all, u_c, w_c = output
    ctx.mark_non_differentiable(c_all, s_all, u_c, w_c)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(u_c, w_c, c_all, s_all)
    ctx.iterations, ctx.detach_votes = iterations, detach_votes


def _backward(ctx, grad_v, grad_c, *_):
    u, weight, c_all, s_all = ctx.saved_tensors
    need_u, need_w = ctx.needs_input_grad[:2]
    if (grad_v is None and grad_c is None) or not (need_u or need_w):
        return None, None, None, None
    grad_u, grad_w = _routing_cpu_backward_op(
        grad_v, grad_c, u, weight, c_all, s_all, ctx.iterations, ctx.detach_votes, need_u, need_w
    )
    return (grad_u if need_u else None), (grad_w if need_w else None), None, None


_routing_cpu_op.register_autograd(_backward, setup_context=_setup_context)


class CpuRouting:
    """Procedure 1 by the fused kernel: the `capsnet::routing_cpu` operator.

    `CpuRouting.apply(u [B, in, in_d], W [in, out, in_d, out_d], iterations, detach_votes)` (same dtype,
    float32/64) returns v [B, out, out_d] and the final coupling coefficients c [B, in, out]. Once differentiable.
    """

    @staticmethod
    def apply(u, weight, iterations, detach_votes):
        v, c, *_ = _routing_cpu_op(u, weight, iterations, detach_votes)
        return v, c


def cpu_dynamic_routing(
    u: torch.Tensor, weight: torch.Tensor, iterations: int, *, detach_votes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Votes û_j|i = W_ij u_i and Procedure 1 by the fused CPU kernel. u [B, in, in_d], W [in, out, in_d, out_d].

    Returns v [B, out, out_d] and the final c [B, in, out], as `capsnet.routing.fast_dynamic_routing`.
    float64 inputs are routed in float64, anything else (e.g. bf16 under autocast) in float32.
    """
    dtype = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    with autocast_off("cpu"):
        return CpuRouting.apply(u.to(dtype), weight.to(dtype), iterations, detach_votes)
