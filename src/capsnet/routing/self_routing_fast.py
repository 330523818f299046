"""Fast self-routing: the parent poses as large-K GEMMs, without the votes.

The plain formulation (`capsnet.routing.self_routing.self_routing`) builds every vote û_j|i = W_ij u_i
[B, in, out, out_d] (47 MB at CapsNet's size, batch 64) with 1152 · 10 products whose inner dimension is in_d (8),
then reduces it. But the parent pose is linear in the votes, and the votes in the inputs: with w_ij = c_ij a_i,

  Σ_i w_ij û_j|i = Σ_(n,i) (w_ij u_in) W_ijnm:   X_j = w_j ⊙ u  [B, in_d·in],   Σ_i w_ij û_j|i = X_j W_j  [B, out_d]

one GEMM per parent j with K = in_d · in (9216 at CapsNet's size), W_j = W[:, j] laid out as [(n, i), m]. The
backward pass is three such GEMMs again (`_WeightedVotes`): Z_j = dnum_j W_jᵀ, then dL/dw_ij = Σ_n u_in Z_jni
and dL/du_in = Σ_j w_ij Z_jni, and dL/dW_j = X_jᵀ dnum_j (X recomputed). The batch runs in chunks, so that the
[out, chunk, in_d·in] temporaries are small and reused.

Matrix poses (the paper's 4×4) fit the same scheme: V_ij = W_ij P_i acts on each column of P_i alone, so the
columns c of the pose matrices are routed like vector capsules of size √d, with the routing weights w_ij shared
by the columns (the batch of the GEMMs becomes B·√d).

Internally tensors are "out-major" [out, B, ..., in]: the softmax over the parents reduces over the outermost
dimension and every elementwise product runs along the long in axis (a softmax over a last dimension of size 10,
as in the plain formulation, is 20× slower on CPUs). The routing logits W^route_i u_i are a sum of in_d such
products (`_RouteLogits`). Measured in docs/benchmarks.md ("Routing algorithms: each layer vs a
transcription of its paper").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .base import autocast_off

EPS = 1e-8  # as capsnet.routing.self_routing.EPS: keeps the two divisions finite where every activation is 0
CHUNK_BYTES = 8 << 20  # the [out, chunk, in_d·in] temporaries of a CPU chunk stay at about 8 MiB


class _RouteLogits(torch.autograd.Function):
    """logits_jbi = Σ_d u_bdi W^route_idj + b^route_ij, out-major: u_t [B, D, in], route_weight [in, D, out] and
    route_bias [in, out] (the parameters' own layouts) -> [out, B, in]. u_p [in, B, D] holds the same inputs as
    u_t, in the layout of the backward's products (its gradient goes to u_t). Once differentiable."""

    @staticmethod
    def forward(ctx: Any, u_t: torch.Tensor, u_p: torch.Tensor, route_weight: torch.Tensor, route_bias: torch.Tensor):
        r_t = route_weight.permute(2, 1, 0).contiguous()  # [out, D, in]
        ctx.save_for_backward(u_p, r_t)
        logits = route_bias.t().unsqueeze(1).expand(-1, u_t.shape[0], -1).clone(memory_format=torch.contiguous_format)
        for d in range(u_t.shape[1]):  # a sum of D products along the long in axis
            logits.addcmul_(u_t[:, d], r_t[:, d].unsqueeze(1))
        return logits

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, Any, Any]:
        u_p, r_t = ctx.saved_tensors
        du = dr = db = None
        if ctx.needs_input_grad[0]:  # dL/du_bdi = Σ_j g_jbi W^route_idj
            du = grad[0].unsqueeze(1) * r_t[0]
            for j in range(1, grad.shape[0]):
                du.addcmul_(grad[j].unsqueeze(1), r_t[j])
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            g_i = grad.permute(2, 1, 0).contiguous()  # [in, B, out]
            if ctx.needs_input_grad[2]:  # dL/dW^route_idj = Σ_b u_bdi g_jbi: one [D, B] @ [B, out] product per i
                dr = torch.bmm(u_p.transpose(1, 2), g_i)
            if ctx.needs_input_grad[3]:
                db = g_i.sum(dim=1)
        return du, None, dr, db


def _scaled_inputs(ca: torch.Tensor, x_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """X_j[(b, c), (n, i)] = ca_jbi x_bcni, written into `out` [out, B·C, N·in]. ca [out, B, in], x_t [B, C, N, in]."""
    torch.mul(ca[:, :, None, None], x_t, out=out.view(ca.shape[0], *x_t.shape))
    return out


# W [in, out, N, M] -> W_j [out, (n, i), m] and back; for matrix poses W_ij[r, k] acts on the rows k of a column:
# W [in, out, M (r), N (k)]
_TO_GEMM = {False: (1, 2, 0, 3), True: (1, 3, 0, 2)}
_FROM_GEMM = {False: (2, 0, 1, 3), True: (2, 0, 3, 1)}


class _WeightedVotes(torch.autograd.Function):
    """num_j = Σ_i ca_ij W_ij x_i = X_j W_j for every column of x: one GEMM per parent j with K = N·in.

    ca [out, B, in] (c_ij a_i), x_t [B, C, N, in] (C columns of N rows; C = 1 for vector poses), weight
    [in, out, N, M] (matrix: [in, out, M, N]) -> [out, B·C, M]. Once differentiable."""

    @staticmethod
    def forward(ctx: Any, ca: torch.Tensor, x_t: torch.Tensor, weight: torch.Tensor, matrix: bool, chunk: int):
        n_out, batch, n_in = ca.shape
        cols = x_t.shape[1]
        w_k = weight.permute(*_TO_GEMM[matrix]).reshape(n_out, x_t.shape[2] * n_in, -1)  # W_j  [out, (n, i), M]
        ctx.save_for_backward(ca, x_t, w_k)
        ctx.matrix, ctx.chunk = matrix, chunk
        x_buf = ca.new_empty(n_out, min(chunk, batch) * cols, w_k.shape[1])
        num = ca.new_empty(n_out, batch * cols, w_k.shape[2])
        for lo in range(0, batch, chunk):
            hi = min(lo + chunk, batch)
            x = _scaled_inputs(ca[:, lo:hi], x_t[lo:hi], x_buf[:, : (hi - lo) * cols])
            num[:, lo * cols : hi * cols] = torch.bmm(x, w_k)  # Σ_i c_ij a_i û_j|i = X_j W_j
        return num

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, Any, None, None]:
        ca, x_t, w_k = ctx.saved_tensors
        need_ca, need_x, need_weight = ctx.needs_input_grad[:3]
        n_out, batch, n_in = ca.shape
        cols, rows = x_t.shape[1:3]
        chunk = ctx.chunk
        dca = torch.empty_like(ca) if need_ca else None
        dx = torch.empty_like(x_t) if need_x else None
        dw_k = w_k.new_zeros(w_k.shape) if need_weight else None
        buf = ca.new_empty(n_out, min(chunk, batch) * cols, w_k.shape[1])
        grad = grad.contiguous()
        for lo in range(0, batch, chunk):
            hi = min(lo + chunk, batch)
            g = grad[:, lo * cols : hi * cols]
            if dca is not None or dx is not None:
                z = torch.bmm(g, w_k.transpose(1, 2), out=buf[:, : (hi - lo) * cols])  # Z_j = dnum_j W_jᵀ
                z = z.view(n_out, hi - lo, cols * rows, n_in)
                x = x_t[lo:hi].view(hi - lo, cols * rows, n_in)
                if dca is not None:  # dL/dca_jbi = Σ_(c,n) x_bcni Z_jbcni
                    part = dca[:, lo:hi]
                    torch.mul(z[:, :, 0], x[:, 0], out=part)
                    for k in range(1, cols * rows):
                        part.addcmul_(z[:, :, k], x[:, k])
                if dx is not None:  # dL/dx_bcni = Σ_j ca_jbi Z_jbcni
                    part = dx[lo:hi].view(hi - lo, cols * rows, n_in)
                    torch.mul(z[0], ca[0, lo:hi, None], out=part)
                    for j in range(1, n_out):
                        part.addcmul_(z[j], ca[j, lo:hi, None])
            if dw_k is not None:  # dL/dW_j = X_jᵀ dnum_j, X recomputed
                x = _scaled_inputs(ca[:, lo:hi], x_t[lo:hi], buf[:, : (hi - lo) * cols])
                dw_k.baddbmm_(x.transpose(1, 2), g)
        dweight = None
        if dw_k is not None:  # in the parameter's own layout, contiguous
            dweight = dw_k.view(n_out, rows, n_in, -1).permute(*_FROM_GEMM[ctx.matrix]).contiguous()
        return dca, dx, dweight, None, None


def default_chunk(batch: int, n_in: int, n_out: int, d_in: int, device: torch.device) -> int:
    """The batch chunk: the whole batch on GPUs; on CPUs, equal chunks whose [out, chunk, in_d·in] fp32
    temporaries hold about CHUNK_BYTES."""
    batch = max(batch, 1)
    if device.type != "cpu":
        return batch
    largest = max(1, CHUNK_BYTES // (4 * n_out * d_in * n_in))
    n_chunks = -(-batch // largest)
    return -(-batch // n_chunks)


def fast_self_routing(
    u: torch.Tensor,
    a: torch.Tensor,
    pose_weight: torch.Tensor | None,
    route_weight: torch.Tensor,
    route_bias: torch.Tensor,
    *,
    matrix_pose: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Self-routing of a fully connected layer, equal to `capsnet.routing.self_routing.self_routing`
    (same arguments and returns: poses [N, n_out, d_out] or None, activations [N, n_out], c [N, n_in, n_out]),
    without forming the votes. float64 inputs run in float64, anything else (e.g. bf16 under autocast) in float32.
    Differentiable once."""
    dtype = u.dtype if u.dtype == torch.float64 else torch.float32
    with autocast_off(u.device.type):
        u, a = u.to(dtype), a.to(dtype)
        batch, n_in, d_in = u.shape
        n_out = route_weight.shape[2]
        u_t = u.transpose(1, 2).contiguous()  # [B, d_in, in]
        u_p = u.detach().transpose(0, 1).contiguous()  # [in, B, d_in]
        logits = _RouteLogits.apply(u_t, u_p, route_weight.to(dtype), route_bias.to(dtype))  # W^route_i u_i + b_i
        c = torch.softmax(logits, dim=0)  # c_ij = softmax over the parents j  [out, B, in]
        ca = c * a.unsqueeze(0)  # c_ij a_i  [out, B, in]
        ca_sum = ca.sum(dim=2)  # Σ_i c_ij a_i  [out, B]
        a_out = (ca_sum / (a.sum(dim=1) + EPS)).t().contiguous()  # a_j = Σ_i c_ij a_i / Σ_i a_i  [B, out]
        c_out = c.permute(1, 2, 0).contiguous()  # [B, in, out], as the reference returns it
        if pose_weight is None:
            return None, a_out, c_out
        if chunk is None:
            chunk = default_chunk(batch, n_in, n_out, d_in, u.device)
        weight = pose_weight.to(dtype)
        if matrix_pose:  # V_ij[:, c] = W_ij P_i[:, c]: the columns c of the pose matrices P_i, routed as vectors
            side = weight.shape[-1]
            x_t = u_t.view(batch, side, side, n_in).transpose(1, 2).contiguous()  # P_i[k, c]  [B, c, k, in]
            num = _WeightedVotes.apply(ca, x_t, weight, True, max(1, chunk))  # [out, B·√d (c), √d (r)]
            num = num.view(n_out, batch, side, side).transpose(2, 3).reshape(n_out, batch, side * side)
        else:
            num = _WeightedVotes.apply(ca, u_t.unsqueeze(1), weight, False, max(1, chunk))  # Σ_i c_ij a_i û_j|i
        pose = (num / (ca_sum.unsqueeze(2) + EPS)).transpose(0, 1).contiguous()  # u_j  [B, out, d_out]
        return pose, a_out, c_out
