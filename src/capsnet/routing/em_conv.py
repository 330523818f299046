"""EM routing for a convolutional capsule layer with the votes formed inside, a few images at a time.

`em_routing` takes the votes V_ij = M_i W_ij  [B, P, J, I, 16] ready-made, and keeps U = [V − c, (V − c)²] (twice
their size) for its backward pass. For ConvCaps at batch 32 on smallNORB that is 1.4 GB, and on CPU most of the time
then goes to the kernel handing out fresh pages, not to arithmetic. `conv_em_routing` instead takes the children's
poses M [B, P, I, 4, 4] and W [J, I, 4, 4] and, for each chunk of images (EM routes each image on its own):

- forms V − c straight into U's layout by one batched product per chunk, batch over the slot i:
  M_i [n·P, 16] @ (I₄ ⊗ W_ij) [16, J·16] (V_ij = M_i W_ij with the 4×4 product written as a 16×16 one, so that each
  row of the result is one whole vote and moving i inside U copies 64-byte runs);
- runs Procedure 1 on it (`capsnet.routing.em`), keeping only the small [n, P, J, ...] results;
- in the backward pass forms U again, replays the small graph, and turns ∂U into ∂M and ∂W with two more batched
  products.

U, ∂U and the chunk of votes live in buffers reused from chunk to chunk (CHUNK_BYTES of U per chunk). c, each
parent's unweighted mean vote, is one GEMM: c_j = (1/I) Σ_i M_i W_ij.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .base import autocast_off
from .em import EMResult, _Options, _route, _route_backward, routing_dtype

CHUNK_BYTES = 192 * 2**20  # U per chunk of images (at least one): 4 images of smallNORB ConvCaps1
# On a GPU fresh memory is not the cost (the caching allocator reuses it) and small chunks would leave it idle, so
# chunks there only bound the peak memory (not measured on a GPU yet).
GPU_CHUNK_BYTES = 2**30


def _block_weight(weight: torch.Tensor) -> torch.Tensor:
    """I₄ ⊗ W_ij as [I, 16, J·16]: row (a', c), column (j, a, d) holds δ_aa' W_ij[c, d], so that the flattened
    M_i [16] times it is the flattened V_ij = M_i W_ij for every j."""
    j, i = weight.shape[:2]
    eye = torch.eye(4, dtype=weight.dtype, device=weight.device)
    return torch.einsum("ae,jicd->iecjad", eye, weight).reshape(i, 16, j * 16)


def _mean_votes(mt: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """c_j = (1/I) Σ_i M_i W_ij, one GEMM over (i, c)  [B·P, J, 16]; mt [I, B·P, 16]."""
    i, n, _ = mt.shape
    j = weight.shape[0]
    rows = mt.view(i, n, 4, 4).permute(1, 2, 0, 3).reshape(n * 4, i * 4)  # (n, a) × (i, c)
    cols = weight.permute(1, 2, 0, 3).reshape(i * 4, j * 4)  # (i, c) × (j, d)
    c = (rows @ cols).div_(i)  # [n·4, J·4]
    return c.view(n, 4, j, 4).permute(0, 2, 1, 3).reshape(n, j, 16)


def _fill_u(u: torch.Tensor, mt: torch.Tensor, wb: torch.Tensor, c: torch.Tensor, scratch: torch.Tensor) -> None:
    """u [n, P, J, I, 32] := [V − c, (V − c)²] for one chunk: mt [I, n·P, 16], c [n, P, J, 16]."""
    n, p, j, i, _ = u.shape
    v = torch.bmm(mt, wb, out=scratch)  # V_ij  [I, n·P, J·16]
    torch.sub(v.view(i, n, p, j, 16).permute(1, 2, 3, 0, 4), c.unsqueeze(3), out=u[..., :16])
    torch.mul(u[..., :16], u[..., :16], out=u[..., 16:])


def _view(buf: torch.Tensor, *shape: int) -> torch.Tensor:
    """The first prod(shape) elements of a flat buffer, as a contiguous tensor of that shape."""
    return buf[: torch.Size(shape).numel()].view(shape)


class _ConvEMRouting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, m, weight, a_in, beta_u, beta_a, opts: _Options, chunk: int):
        bsz, p, j, i, h = opts.shape
        mt = m.reshape(bsz * p, i, h).transpose(0, 1).contiguous()  # M_i  [I, B·P, 16]
        wb = _block_weight(weight)
        c = _mean_votes(mt, weight).view(bsz, p, j, h)  # [B, P, J, 16]
        u_buf, v_buf = m.new_empty(chunk * p * j * i * 2 * h), m.new_empty(chunk * p * i * j * h)
        outs = []
        for b0 in range(0, bsz, chunk):
            n = min(chunk, bsz - b0)
            u = _view(u_buf, n, p, j, i, 2 * h)
            _fill_u(u, mt[:, b0 * p : (b0 + n) * p], wb, c[b0 : b0 + n], _view(v_buf, i, n * p, j * h))
            opts_n = opts._replace(shape=(n, p, j, i, h))
            outs.append(_route(u, a_in[b0 : b0 + n], beta_u, beta_a, opts_n))
        mu_c, logits, r = (torch.cat([o[k] for o in outs]) for k in range(3))
        qs = [torch.cat([o[3][t] for o in outs]) for t in range(opts.iterations)]
        es = [torch.cat([o[4][t] for o in outs]) for t in range(opts.iterations - 1)]
        ctx.opts, ctx.chunk, ctx.m_shape = opts, chunk, m.shape
        ctx.save_for_backward(mt, weight, c, a_in, beta_u, beta_a, *qs, *es)
        return mu_c + c, torch.sigmoid(logits), logits, r

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        opts, chunk = ctx.opts, ctx.chunk
        bsz, p, j, i, h = opts.shape
        mt, weight, c, a_in, beta_u, beta_a, *saved = ctx.saved_tensors
        qs, es = saved[: opts.iterations], saved[opts.iterations :]
        need_m, need_w, *need_small = ctx.needs_input_grad[:5]
        betas = [x.detach().requires_grad_(need) for x, need in zip((beta_u, beta_a), need_small[1:])]
        wb = _block_weight(weight)
        g_mt = mt.new_empty(bsz * p, i, h) if need_m else None  # ∂M  [B·P, I, 16]
        g_wb = torch.zeros_like(wb) if need_w else None  # ∂(I₄ ⊗ W)  [I, 16, J·16]
        u_buf, g_buf = (mt.new_empty(chunk * p * j * i * 2 * h) for _ in range(2))
        v_buf = mt.new_empty(chunk * p * i * j * h)
        g_a = []
        for b0 in range(0, bsz, chunk):
            n, s = min(chunk, bsz - b0), slice(b0, b0 + min(chunk, bsz - b0))
            u, v = _view(u_buf, n, p, j, i, 2 * h), _view(v_buf, i, n * p, j * h)
            mt_s = mt[:, b0 * p : (b0 + n) * p]
            _fill_u(u, mt_s, wb, c[s], v)
            a_leaf = a_in[s].detach().requires_grad_(need_small[0])
            g_s = [None if g is None else g[s] for g in grads]
            opts_n = opts._replace(shape=(n, p, j, i, h))
            g_u = _route_backward(
                u,
                [a_leaf, *betas],
                [q[s] for q in qs],
                [e[s] for e in es],
                g_s,
                opts_n,
                out=_view(g_buf, n, p, j, i, 2 * h),
            )
            g_a.append(a_leaf.grad if a_leaf.grad is not None else torch.zeros_like(a_leaf))
            if not (need_m or need_w):
                continue
            # U = [x, x²] with x = V − c: ∂V = ∂U[:h] + 2 x ∂U[h:]  (c is a constant: the outputs do not depend on it)
            g_v = g_u[..., :h].addcmul_(u[..., :h], g_u[..., h:], value=2.0)  # [n, P, J, I, 16]
            v.view(i, n, p, j, h).copy_(g_v.permute(3, 0, 1, 2, 4))  # ∂V_ij as [I, n·P, J·16]
            if g_mt is not None:  # ∂M_i = Σ_j ∂V_ij (I₄ ⊗ W_ij)ᵀ
                g_mt[b0 * p : (b0 + n) * p] = torch.bmm(v, wb.transpose(1, 2)).transpose(0, 1)
            if g_wb is not None:  # ∂(I₄ ⊗ W_ij) = Σ_{b, p} M_iᵀ ∂V_ij
                g_wb.baddbmm_(mt_s.transpose(1, 2), v)
        g_m = g_mt.view(ctx.m_shape) if g_mt is not None else None
        # W_ij[c, d] sits at every diagonal block a = a' of I₄ ⊗ W_ij: its gradient is their sum
        g_w = torch.einsum("iacjad->jicd", g_wb.view(i, 4, 4, j, 4, 4)) if g_wb is not None else None
        g_a_in = torch.cat(g_a) if need_small[0] else None
        return g_m, g_w, g_a_in, *[x.grad if x.requires_grad else None for x in betas], None, None


def conv_em_routing(
    poses: torch.Tensor,
    weight: torch.Tensor,
    activations: torch.Tensor,
    beta_u: torch.Tensor,
    beta_a: torch.Tensor,
    *,
    iterations: int,
    final_lambda: float,
    child_index: torch.Tensor,
    n_children: int,
    min_var: float,
    chunk_bytes: int | None = None,
) -> EMResult:
    """`em_routing` of the votes V_ij = M_i W_ij without materialising them for the whole batch.

    poses M_i of the child in each slot [B, P, I, 4, 4] (or [.., 16]); weight W_ij [J, I, 4, 4]; activations a_i
    [B, P, I]; β_u, β_a [J]; `child_index` [P, I] as in `em_routing`. The result and its gradients equal
    `em_routing(einsum("bpiac,jicd->bpjiad", M, W), ...)` up to rounding. `chunk_bytes`: U's size per chunk of
    images (default CHUNK_BYTES on CPUs, GPU_CHUNK_BYTES elsewhere)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    bsz, p, i = activations.shape
    j = weight.shape[0]
    opts = _Options((bsz, p, j, i, 16), iterations, final_lambda, min_var, child_index, n_children)
    dtype = routing_dtype(poses)
    per_image = p * j * i * 32 * dtype.itemsize  # bytes of U
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES if poses.device.type == "cpu" else GPU_CHUNK_BYTES
    chunk = max(1, min(bsz, chunk_bytes // per_image))
    with autocast_off(poses.device.type):  # (bf16 under autocast: routed in fp32)
        m, a_in = poses.reshape(bsz, p, i, 16).to(dtype), activations.to(dtype).unsqueeze(2)
        poses, acts, logits, r = _ConvEMRouting.apply(m, weight.to(dtype), a_in, beta_u, beta_a, opts, chunk)
    return EMResult(poses, acts, logits, r)
