"""Fast dynamic routing (Procedure 1) without materializing the votes û_j|i.

The plain formulation (`capsnet.routing.dynamic_routing`) first builds all votes û [B, in, out, out_d]
with a batched matmul over the input capsules whose inner dimension is in_d (8 for MNIST), and then
reduces that large tensor with more small-inner-dimension matmuls. Both are slow on CPUs.

Here every routing step is rewritten so that the contraction runs over K = in_d · in_caps (9216 for MNIST):

  "sum" step    s_j  = Σ_i c_ij û_j|i = Σ_(n,i) (c_ij u_in) W_ijnm:  X_j = c_j ⊙ u, s_j = X_j W_j
  "agree" step  a_ij = û_j|i · v_j   = Σ_n u_in (W_ij v_j)_n:        Z_j = v_j W_jᵀ, a_ij = Σ_n u_in Z_jin

with W_j = W[:, j] laid out as [(n, i), m]; and the first pass (uniform c_ij = 1/out) is a single GEMM
u [B, in_d·in] @ W [(in_d·in), (out·out_d)]. Internally tensors are "out-major": [out, B, ...] (so the
softmax over the output capsules reduces over the outermost dimension) and inputs are [B, in_d, in] (so the
elementwise products run along the long in_caps axis).

The backward pass is derived by hand (`FastRouting`, registered as the custom operators
``capsnet::fast_routing`` and ``capsnet::fast_routing_backward``): it keeps only the small per-iteration s_j and
c_ij, walks Procedure 1 backwards, and expresses dL/dû = Σ_t (c_t ⊗ ds_t + da_t ⊗ v_t) through the same two
kinds of products, so dL/du and dL/dW are again large-K GEMMs. The batch is processed in chunks so that the
[out, chunk, in_d, in] temporaries stay in the CPU caches.

Cost: about 14 GEMMs of |û|·in_d multiply-adds each per forward+backward (r = 3) instead of the 3, at a poor
efficiency, of labml's einsum formulation. Measured in docs/benchmarks.md#routing-router-vs-labmls-formulation.
"""

from __future__ import annotations

from typing import Any

import torch

from ..nn.squash import squash
from .base import autocast_off


def _squash_backward(s: torch.Tensor, grad_v: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """dL/ds for v = s·f(q), q = |s|², f(q) = q / ((1+q)·sqrt(q+eps)):  ds = f·dv + 2·f'(q)·(s·dv)·s."""
    q = (s * s).sum(dim=-1, keepdim=True)
    g = 1.0 / ((1.0 + q) * torch.sqrt(q + eps))  # f = q·g
    f_prime = g * (1.0 - q / (1.0 + q) - 0.5 * q / (q + eps))  # f' = g + q·g'
    return grad_v * (q * g) + s * (2.0 * f_prime * (s * grad_v).sum(dim=-1, keepdim=True))


def weight_layouts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [in, out, in_d, out_d] -> (W_k [out, in_d·in, out_d], W_flat [in_d·in, out·out_d]): new contiguous
    tensors, never views of W (whatever its shape)."""
    n_in, n_out, d_in, d_out = weight.shape
    w_k = weight.new_empty(n_out, d_in * n_in, d_out)
    w_k.view(n_out, d_in, n_in, d_out).copy_(weight.permute(1, 2, 0, 3))
    w_flat = weight.new_empty(d_in * n_in, n_out * d_out)
    w_flat.view(d_in, n_in, n_out, d_out).copy_(weight.permute(2, 0, 1, 3))
    return w_k, w_flat


def _transposed_inputs(u: torch.Tensor) -> torch.Tensor:
    """u [B, in, in_d] -> a new contiguous u_t [B, in_d, in]."""
    u_t = u.new_empty(u.shape[0], u.shape[2], u.shape[1])
    return u_t.copy_(u.transpose(1, 2))


def _agree(y: torch.Tensor, w_k: torch.Tensor, u_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Z_j = y_j W_jᵀ  [out, Bc, in_d, in] and Σ_m û_j|i,m y_jm = Σ_n u_in Z_jin  [out, Bc, in]. y [out, Bc, out_d]."""
    z = torch.bmm(y, w_k.transpose(1, 2)).view(y.shape[0], *u_t.shape)
    return z, (z * u_t).sum(dim=2)


def _scaled_inputs(w: torch.Tensor, u_t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """X_jbni = w_jbi · u_bni, flattened to [out, Bc, in_d·in] (written into `out` when given). w [out, Bc, in]."""
    if out is None:
        return (w.unsqueeze(2) * u_t).flatten(2)
    torch.mul(w.unsqueeze(2), u_t, out=out.view(w.shape[0], *u_t.shape))
    return out


def _sum(w: torch.Tensor, w_k: torch.Tensor, u_t: torch.Tensor, out: torch.Tensor | None = None):
    """X_j = w_j ⊙ u  [out, Bc, in_d·in] and Σ_i w_ij û_j|i = X_j W_j  [out, Bc, out_d]. w [out, Bc, in]."""
    x = _scaled_inputs(w, u_t, out)
    return x, torch.bmm(x, w_k)


def _coupling(b: torch.Tensor, leaky: bool) -> torch.Tensor:
    """Eq. 3: c_ij = softmax_j(b_ij) over the outputs (dim 0 here); leaky (§7): with an extra logit 0, dropped."""
    if not leaky:
        return torch.softmax(b, dim=0)
    return torch.softmax(torch.cat([b, b.new_zeros(1, *b.shape[1:])]), dim=0)[:-1]


def _route_chunk(u_t, w_k, w_flat, iterations, leaky=False, bias=None):
    """Procedure 1 for one batch chunk. u_t [Bc, in_d, in]. Returns s_t [out, Bc, out_d] and c_t [out, Bc, in]
    for every pass t (c of the first, uniform, pass is None); the backward pass recomputes everything else."""
    n_out, _, d_out = w_k.shape
    batch = u_t.shape[0]
    # First pass, c_ij = 1/out: s_j = (1/out) Σ_(n,i) u_in W_ijnm, one GEMM  [Bc, out·out_d]
    s = (u_t.reshape(batch, -1) @ w_flat).view(batch, n_out, d_out).transpose(0, 1) / (n_out + leaky)
    bias = bias[:, None] if bias is not None else None  # [out, 1, out_d], added to s_j before every squash
    s = s + bias if bias is not None else s
    ss: list[torch.Tensor] = [s]
    cs: list[torch.Tensor | None] = [None]
    b = None
    for _ in range(1, iterations):
        _, a = _agree(squash(s), w_k, u_t)  # b_ij ← b_ij + û_j|i · v_j  [out, Bc, in]
        b = a if b is None else b + a
        c = _coupling(b, leaky)  # Eq. 3: c_ij = softmax_j(b_ij)  [out, Bc, in]
        _, s = _sum(c, w_k, u_t)  # s_j = Σ_i c_ij û_j|i  [out, Bc, out_d]
        s = s + bias if bias is not None else s
        ss.append(s)
        cs.append(c)
    return ss, cs


def _backward_chunk(u_t, w_k, w_flat, ss, cs, grad_v, grad_c, detach_votes, need_u, leaky=False, need_bias=False):
    """Reverse of `_route_chunk`. grad_v [out, Bc, out_d], grad_c [out, Bc, in] or None.

    Returns du [Bc, in_d, in] (None unless need_u) and this chunk's dL/dW in the two layouts of
    `weight_layouts` (dW_k transposed to [out, out_d, in_d·in]; either may be None)."""
    n_out = w_k.shape[0]
    batch = u_t.shape[0]
    r = len(ss)
    du = torch.zeros_like(u_t) if need_u else None
    # dW_j = Σ_pairs y_jᵀ X_j: the X's are written side by side into one buffer, for one GEMM with K = pairs·Bc
    n_pairs = (1 if r > 1 else 0) if detach_votes else 2 * (r - 1)
    x_buf = u_t.new_empty(n_out, n_pairs * batch, u_t.shape[1] * u_t.shape[2])
    ys: list[torch.Tensor] = []
    dw_flat = None
    ds = _squash_backward(ss[-1], grad_v)  # dL/ds_r
    dbias = None
    db: Any = None  # dL/db_(t+1), accumulated backwards (a tensor from the second-to-last pass on)
    first = r - 1 if detach_votes else 0  # detach_votes: û gets gradient from the last pass only
    for t in range(r - 1, first - 1, -1):
        if t < r - 1:
            # b_(t+1) = b_t + a_t, a_ij = û_j|i · v_j:  da = db,  dv_j = Σ_i da_ij û_j|i,  dû += da ⊗ v
            v = squash(ss[t])
            _, dv = _sum(db, w_k, u_t, out=x_buf[:, len(ys) * batch : (len(ys) + 1) * batch])
            ys.append(v)
            if need_u:
                z = torch.bmm(v, w_k.transpose(1, 2)).view(n_out, *u_t.shape)  # Z_t = v_t W_jᵀ, recomputed
                du += (db.unsqueeze(2) * z).sum(dim=0)  # Σ_j da_ij (W_ij v_j)
            ds = _squash_backward(ss[t], dv)
        if need_bias:  # s_t = ... + bias: dL/dbias = Σ_t Σ_batch dL/ds_t (detach_votes: the caller refuses a bias)
            dbias = ds.sum(dim=1) if dbias is None else dbias + ds.sum(dim=1)
        if t == 0:
            # s_1 = Σ_i (1/out) û_j|i: dû += (1/out) ⊗ ds, again as single GEMMs
            g = ds.transpose(0, 1).reshape(batch, -1) / (n_out + leaky)  # [Bc, out·out_d]
            if need_u:
                du += (g @ w_flat.t()).view_as(u_t)
            dw_flat = u_t.reshape(batch, -1).t() @ g
            continue
        c = cs[t]
        # s_j = Σ_i c_ij û_j|i:  dc_ij = û_j|i · ds_j,  dû += c ⊗ ds
        z, dc = _agree(ds, w_k, u_t)
        if need_u:
            du += (c.unsqueeze(2) * z).sum(dim=0)
        _scaled_inputs(c, u_t, out=x_buf[:, len(ys) * batch : (len(ys) + 1) * batch])
        ys.append(ds)
        if detach_votes:
            break  # c_r came from detached votes: no gradient flows through it
        if t == r - 1 and grad_c is not None:
            dc = dc + grad_c
        # softmax backward over j; the same for the leaky softmax, whose extra logit is a constant
        dsoft = c * (dc - (c * dc).sum(dim=0, keepdim=True))
        db = dsoft if db is None else db + dsoft
    dw_k = torch.bmm(torch.cat(ys, dim=1).transpose(1, 2), x_buf) if ys else None  # [out, out_d, in_d·in]
    return du, dw_k, dw_flat, dbias


GPU_TEMPORARY_BYTES = 512 << 20  # the largest [out, chunk, in_d, in] fp32 temporary of a GPU chunk


def default_chunk(batch: int, n_in: int, n_out: int, d_in: int, device: torch.device) -> int:
    """Batch chunk for the fast path: on CPUs, equal chunks with one [out, chunk, in_d, in] fp32 temporary of at
    most about 12 MiB (so the temporaries stay in L2/L3; 32 for MNIST at batch 64 or 128); on GPUs, the whole batch
    unless one such temporary would exceed GPU_TEMPORARY_BYTES (large images: about 10 of them are alive in the
    backward pass). (Much smaller chunks mean many small ops, which suffer when the CPU cores are shared.)"""
    batch = max(batch, 1)
    per_example = 4 * n_out * d_in * n_in
    if device.type != "cpu" and batch * per_example <= GPU_TEMPORARY_BYTES:
        return batch
    largest = max(1, (GPU_TEMPORARY_BYTES if device.type != "cpu" else 12 << 20) // per_example)
    n_chunks = -(-batch // largest)
    return -(-batch // n_chunks)


# ------------------------------------------------------------------------------------------------ custom ops
# Procedure 1 is registered as two operators, `capsnet::fast_routing` and its backward, so that torch.compile sees
# one opaque node each (no graph break, no tracing into the chunk loop) and AOTAutograd puts the hand-derived
# backward into the backward graph. Fake implementations give the output shapes and strides. The forward operator
# also returns its private copies of the inputs in the layouts used here (u_t, W_k, W_flat: new tensors, never
# views, as operators must return), which the backward pass uses: later in-place changes of u or W can't reach it.


@torch.library.custom_op("capsnet::fast_routing", mutates_args=())
def _fast_routing_op(
    u: torch.Tensor,
    weight: torch.Tensor,
    iterations: int,
    detach_votes: bool,
    chunk: int,
    leaky: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v [B, out, out_d], c [B, in, out], s_all [r, out, B, out_d], c_all [r-1, out, B, in], u_t, W_k, W_flat)."""
    batch, n_in, _ = u.shape
    _, n_out, _, d_out = weight.shape
    w_k, w_flat = weight_layouts(weight)
    u_t = _transposed_inputs(u)  # [B, in_d, in]
    s_all = u.new_empty(iterations, n_out, batch, d_out)
    c_all = u.new_empty(iterations - 1, n_out, batch, n_in)
    for lo in range(0, batch, chunk):
        ss, cs = _route_chunk(u_t[lo : lo + chunk], w_k, w_flat, iterations, leaky, bias)
        s_all[:, :, lo : lo + chunk] = torch.stack(ss)
        if iterations > 1:
            c_all[:, :, lo : lo + chunk] = torch.stack(cs[1:])
    v = squash(s_all[-1]).transpose(0, 1).contiguous()  # [B, out, out_d]
    if iterations > 1:
        c = c_all[-1].permute(1, 2, 0).clone(memory_format=torch.contiguous_format)
    else:  # the single pass couples uniformly
        c = u.new_full((batch, n_in, n_out), 1.0 / (n_out + leaky))
    return v, c, s_all, c_all, u_t, w_k, w_flat


@_fast_routing_op.register_fake
def _(u, weight, iterations, detach_votes, chunk, leaky=False, bias=None):
    batch, n_in, d_in = u.shape
    _, n_out, _, d_out = weight.shape
    return (
        u.new_empty(batch, n_out, d_out),
        u.new_empty(batch, n_in, n_out),
        u.new_empty(iterations, n_out, batch, d_out),
        u.new_empty(iterations - 1, n_out, batch, n_in),
        u.new_empty(batch, d_in, n_in),
        weight.new_empty(n_out, d_in * n_in, d_out),
        weight.new_empty(d_in * n_in, n_out * d_out),
    )


@torch.library.custom_op("capsnet::fast_routing_backward", mutates_args=())
def _fast_routing_backward_op(
    grad_v: torch.Tensor | None,
    grad_c: torch.Tensor | None,
    u_t: torch.Tensor,
    w_k: torch.Tensor,
    w_flat: torch.Tensor,
    s_all: torch.Tensor,
    c_all: torch.Tensor,
    detach_votes: bool,
    chunk: int,
    need_u: bool,
    need_w: bool,
    leaky: bool = False,
    need_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/du [B, in, in_d], dL/dW [in, out, in_d, out_d] contiguous, as the parameter, dL/dbias [out, out_d]); an
    empty tensor stands for a gradient that is not needed."""
    batch, d_in, n_in = u_t.shape
    n_out, _, d_out = w_k.shape
    grad_v = grad_v.transpose(0, 1) if grad_v is not None else u_t.new_zeros(n_out, batch, d_out)  # [out, B, out_d]
    if grad_c is not None:
        grad_c = grad_c.permute(2, 0, 1)  # [out, B, in]
    du: Any = u_t.new_empty(batch, d_in, n_in) if need_u else None
    dw_k = w_k.new_zeros(n_out, d_out, d_in * n_in)  # dL/dW in the [out, out_d, (in_d, in)] layout
    dw_flat = w_k.new_zeros(d_in * n_in, n_out * d_out)  # ... and in the [(in_d, in), (out, out_d)] one
    grad_bias = w_k.new_zeros(n_out, d_out) if need_bias else w_k.new_empty(0)
    for lo in range(0, batch, chunk):
        hi = min(lo + chunk, batch)
        ss = list(s_all[:, :, lo:hi].contiguous().unbind(0))
        cs = [None, *c_all[:, :, lo:hi].contiguous().unbind(0)]
        gc = grad_c[:, lo:hi] if grad_c is not None else None
        du_c, dwk, dwf, dbias = _backward_chunk(
            u_t[lo:hi],
            w_k,
            w_flat,
            ss,
            cs,
            grad_v[:, lo:hi].contiguous(),
            gc,
            detach_votes,
            need_u,
            leaky,
            need_bias,
        )
        if need_bias:
            grad_bias += dbias
        if need_u:
            du[lo:hi] = du_c
        if need_w:
            if dwk is not None:
                dw_k += dwk
            if dwf is not None:
                dw_flat += dwf
    grad_u = du.transpose(1, 2) if need_u else u_t.new_empty(0)
    grad_w = w_k.new_empty(0)
    if need_w:  # the two layouts summed straight into W's own (contiguous) layout: no strided gradient for DDP
        grad_w = w_k.new_empty(n_in, n_out, d_in, d_out)
        torch.add(
            dw_k.view(n_out, d_out, d_in, n_in).permute(3, 0, 2, 1),
            dw_flat.view(d_in, n_in, n_out, d_out).permute(1, 2, 0, 3),
            out=grad_w,
        )
    return grad_u, grad_w, grad_bias


@_fast_routing_backward_op.register_fake
def _(
    grad_v, grad_c, u_t, w_k, w_flat, s_all, c_all, detach_votes, chunk, need_u, need_w, leaky=False, need_bias=False
):
    batch, d_in, n_in = u_t.shape
    n_out, _, d_out = w_k.shape
    grad_u = u_t.new_empty(batch, d_in, n_in).transpose(1, 2) if need_u else u_t.new_empty(0)
    grad_bias = w_k.new_empty(n_out, d_out) if need_bias else w_k.new_empty(0)
    return grad_u, (w_k.new_empty(n_in, n_out, d_in, d_out) if need_w else w_k.new_empty(0)), grad_bias


def _fast_setup_context(ctx, inputs, output) -> None:
    _, _, _, detach_votes, chunk, *options = inputs  # options: leaky, bias (when given)
    _, _, *saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*saved)
    ctx.config = (detach_votes, chunk)
    ctx.leaky = bool(options and options[0])
    ctx.has_bias = len(options) > 1 and options[1] is not None


def _fast_backward(ctx, grad_v, grad_c, *_):
    s_all, c_all, u_t, w_k, w_flat = ctx.saved_tensors
    need_u, need_w = ctx.needs_input_grad[:2]
    need_bias = ctx.has_bias and ctx.needs_input_grad[6]
    if (grad_v is None and grad_c is None) or not (need_u or need_w or need_bias):
        return None, None, None, None, None, None, None
    grad_u, grad_w, grad_bias = _fast_routing_backward_op(
        grad_v, grad_c, u_t, w_k, w_flat, s_all, c_all, *ctx.config, need_u, need_w, ctx.leaky, need_bias
    )
    return (
        (grad_u if need_u else None),
        (grad_w if need_w else None),
        None,
        None,
        None,
        None,
        (grad_bias if need_bias else None),
    )


_fast_routing_op.register_autograd(_fast_backward, setup_context=_fast_setup_context)


class FastRouting:
    """Procedure 1 with a hand-derived, recomputing backward: the `capsnet::fast_routing` operator.

    `FastRouting.apply(u [B, in, in_d], W [in, out, in_d, out_d], iterations, detach_votes, chunk)` returns v
    [B, out, out_d] and the final coupling coefficients c [B, in, out]. Once differentiable (the backward
    operator has no derivative of its own).
    """

    @staticmethod
    def apply(u, weight, iterations, detach_votes, chunk, leaky=False, bias=None):
        v, c, *_ = _fast_routing_op(u, weight, iterations, detach_votes, chunk, leaky, bias)
        return v, c


def fast_dynamic_routing(
    u: torch.Tensor,
    weight: torch.Tensor,
    iterations: int,
    *,
    detach_votes: bool = False,
    chunk: int | None = None,
    leaky: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Votes û_j|i = W_ij u_i and Procedure 1 in one step. u [B, in, in_d], W [in, out, in_d, out_d].

    Returns v [B, out, out_d] and the final c [B, in, out], equal to
    ``dynamic_routing(route_votes(weight, u), iterations, detach_votes=detach_votes, leaky=leaky)`` (leaky: §7's
    "none-of-the-above" routing, an extra zero logit in the softmax over the outputs; bias [out, out_d]: added to
    s_j before every squash, as the official code's capsule layers; not with detach_votes, whose hand-derived
    backward drops the routing logits' gradient, which a bias would have).
    bf16/fp16 inputs (e.g. under autocast) are routed in fp32; the outputs are then fp32.
    """
    dtype = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    if chunk is None:
        chunk = default_chunk(u.shape[0], weight.shape[0], weight.shape[1], weight.shape[2], u.device)
    with autocast_off(u.device.type):
        if bias is not None and detach_votes:
            raise ValueError("fast_dynamic_routing: a bias with detach_votes takes the reference path (Router does)")
        bias = bias.to(dtype) if bias is not None else None
        return FastRouting.apply(u.to(dtype), weight.to(dtype), iterations, detach_votes, max(1, chunk), leaky, bias)
