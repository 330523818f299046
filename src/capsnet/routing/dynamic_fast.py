"""Fast dynamic routing (Procedure 1) without materializing the votes û_j|i.

The plain formulation (:func:`capsnet.routing.dynamic_routing`) first builds all votes û [B, in, out, out_d]
with a batched matmul over the input capsules whose inner dimension is in_d (8 for MNIST), and then
reduces that large tensor with more small-inner-dimension matmuls. Both are slow on CPUs.

Here every routing step is rewritten so that the contraction runs over K = in_d · in_caps (9216 for MNIST):

  "sum" step    s_j  = Σ_i c_ij û_j|i = Σ_(n,i) (c_ij u_in) W_ijnm:  X_j = c_j ⊙ u, s_j = X_j W_j
  "agree" step  a_ij = û_j|i · v_j   = Σ_n u_in (W_ij v_j)_n:        Z_j = v_j W_jᵀ, a_ij = Σ_n u_in Z_jin

with W_j = W[:, j] laid out as [(n, i), m]; and the first pass (uniform c_ij = 1/out) is a single GEMM
u [B, in_d·in] @ W [(in_d·in), (out·out_d)]. Internally tensors are "out-major": [out, B, ...] (so the
softmax over the output capsules reduces over the outermost dimension) and inputs are [B, in_d, in] (so the
elementwise products run along the long in_caps axis).

The backward pass is derived by hand (:class:`FastRouting`): it keeps only the small per-iteration s_j and
c_ij, walks Procedure 1 backwards, and expresses dL/dû = Σ_t (c_t ⊗ ds_t + da_t ⊗ v_t) through the same two
kinds of products, so dL/du and dL/dW are again large-K GEMMs. The batch is processed in chunks so that the
[out, chunk, in_d, in] temporaries stay in the CPU caches.

Cost: about 14 GEMMs of |û|·in_d multiply-adds each per forward+backward (r = 3) instead of the seed's 3 at a
poor efficiency. Measured on a 2-core CPU (benchmarks/bench_routing.py): 1.0–2.3× the seed's speed and half
its peak memory at batch 64–128 — not more, and slower than the seed when the cores are oversubscribed
(many small ops). The GEMM-heavy form is meant to suit GPUs better; that is not measured yet.
"""

from __future__ import annotations

import torch

from ..nn.squash import squash


def _squash_backward(s: torch.Tensor, grad_v: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """dL/ds for v = s·f(q), q = |s|², f(q) = q / ((1+q)·sqrt(q+eps)):  ds = f·dv + 2·f'(q)·(s·dv)·s."""
    q = (s * s).sum(dim=-1, keepdim=True)
    g = 1.0 / ((1.0 + q) * torch.sqrt(q + eps))  # f = q·g
    f_prime = g * (1.0 - q / (1.0 + q) - 0.5 * q / (q + eps))  # f' = g + q·g'
    return grad_v * (q * g) + s * (2.0 * f_prime * (s * grad_v).sum(dim=-1, keepdim=True))


def weight_layouts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [in, out, in_d, out_d] -> (W_k [out, in_d·in, out_d], W_flat [in_d·in, out·out_d]), both contiguous."""
    n_in, n_out, d_in, d_out = weight.shape
    w_k = weight.permute(1, 2, 0, 3).reshape(n_out, d_in * n_in, d_out)
    w_flat = weight.permute(2, 0, 1, 3).reshape(d_in * n_in, n_out * d_out)
    return w_k, w_flat


def _own(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`t`, cloned if it still shares memory with `source` (so that in-place changes of the input can't reach it)."""
    return t.clone() if t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() else t


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


def _route_chunk(u_t, w_k, w_flat, iterations):
    """Procedure 1 for one batch chunk. u_t [Bc, in_d, in]. Returns s_t [out, Bc, out_d] and c_t [out, Bc, in]
    for every pass t (c of the first, uniform, pass is None), and Z_t = v_t W_jᵀ [out, Bc, in_d, in] of every pass
    but the last (the backward pass reuses them for dL/du)."""
    n_out, _, d_out = w_k.shape
    batch = u_t.shape[0]
    # First pass, c_ij = 1/out: s_j = (1/out) Σ_(n,i) u_in W_ijnm, one GEMM  [Bc, out·out_d]
    s = (u_t.reshape(batch, -1) @ w_flat).view(batch, n_out, d_out).transpose(0, 1) / n_out
    ss, cs, zs = [s], [None], []
    b = None
    for _ in range(1, iterations):
        z, a = _agree(squash(s), w_k, u_t)  # b_ij ← b_ij + û_j|i · v_j  [out, Bc, in]
        zs.append(z)
        b = a if b is None else b + a
        c = torch.softmax(b, dim=0)  # Eq. 3: c_ij = softmax_j(b_ij)  [out, Bc, in]
        _, s = _sum(c, w_k, u_t)  # s_j = Σ_i c_ij û_j|i  [out, Bc, out_d]
        ss.append(s)
        cs.append(c)
    return ss, cs, zs


def _backward_chunk(u_t, w_k, w_flat, ss, cs, zs, grad_v, grad_c, detach_votes, need_u):
    """Reverse of :func:`_route_chunk`. grad_v [out, Bc, out_d], grad_c [out, Bc, in] or None; zs as returned by
    :func:`_route_chunk` (needed only when need_u and not detach_votes).

    Returns du [Bc, in_d, in] (None unless need_u) and this chunk's dL/dW in the two layouts of
    :func:`weight_layouts` (dW_k transposed to [out, out_d, in_d·in]; either may be None)."""
    n_out = w_k.shape[0]
    batch = u_t.shape[0]
    r = len(ss)
    du = torch.zeros_like(u_t) if need_u else None
    # dW_j = Σ_pairs y_jᵀ X_j: the X's are written side by side into one buffer, for one GEMM with K = pairs·Bc
    n_pairs = (1 if r > 1 else 0) if detach_votes else 2 * (r - 1)
    x_buf = u_t.new_empty(n_out, n_pairs * batch, u_t.shape[1] * u_t.shape[2])
    ys = []
    dw_flat = None
    ds = _squash_backward(ss[-1], grad_v)  # dL/ds_r
    db = None  # dL/db_(t+1), accumulated backwards
    first = r - 1 if detach_votes else 0  # detach_votes: û gets gradient from the last pass only
    for t in range(r - 1, first - 1, -1):
        if t < r - 1:
            # b_(t+1) = b_t + a_t, a_ij = û_j|i · v_j:  da = db,  dv_j = Σ_i da_ij û_j|i,  dû += da ⊗ v
            v = squash(ss[t])
            _, dv = _sum(db, w_k, u_t, out=x_buf[:, len(ys) * batch : (len(ys) + 1) * batch])
            ys.append(v)
            if need_u:
                z = zs[t] if zs else torch.bmm(v, w_k.transpose(1, 2)).view(n_out, *u_t.shape)
                du += (db.unsqueeze(2) * z).sum(dim=0)  # Σ_j da_ij (W_ij v_j)
            ds = _squash_backward(ss[t], dv)
        if t == 0:
            # s_1 = Σ_i (1/out) û_j|i: dû += (1/out) ⊗ ds, again as single GEMMs
            g = ds.transpose(0, 1).reshape(batch, -1) / n_out  # [Bc, out·out_d]
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
        dsoft = c * (dc - (c * dc).sum(dim=0, keepdim=True))  # softmax backward over j
        db = dsoft if db is None else db + dsoft
    dw_k = torch.bmm(torch.cat(ys, dim=1).transpose(1, 2), x_buf) if ys else None  # [out, out_d, in_d·in]
    return du, dw_k, dw_flat


KEEP_Z = False  # keep Z_t = v_t W_jᵀ from the forward pass instead of recomputing it (more memory, 2 fewer GEMMs)


def default_chunk(batch: int, n_in: int, n_out: int, d_in: int, device: torch.device) -> int:
    """Batch chunk for the fast path: on CPUs, equal chunks with one [out, chunk, in_d, in] fp32 temporary of at
    most about 12 MiB (so the temporaries stay in L2/L3; 32 for MNIST at batch 64 or 128); on GPUs, the whole batch.
    (Much smaller chunks mean many small ops, which suffer when the CPU cores are shared.)"""
    batch = max(batch, 1)
    if device.type != "cpu":
        return batch
    largest = max(1, (12 << 20) // (4 * n_out * d_in * n_in))
    n_chunks = -(-batch // largest)
    return -(-batch // n_chunks)


class FastRouting(torch.autograd.Function):
    """Procedure 1 with a hand-derived, recomputing backward. Inputs u [B, in, in_d], W [in, out, in_d, out_d].

    Outputs v [B, out, out_d] and the final coupling coefficients c [B, in, out]. Once differentiable.
    """

    @staticmethod
    def forward(ctx, u, weight, iterations, detach_votes, chunk):
        ctx.set_materialize_grads(False)
        batch, n_in, d_in = u.shape
        _, n_out, _, d_out = weight.shape
        # Private copies in the layouts used here (the backward pass needs no reference to the inputs).
        w_k, w_flat = (_own(t, weight) for t in weight_layouts(weight))
        u_t = _own(u.transpose(1, 2).contiguous(), u)  # [B, in_d, in]
        s_all = u.new_empty(iterations, n_out, batch, d_out)
        c_all = u.new_empty(iterations - 1, n_out, batch, n_in)
        # Keeping Z_t = v_t W_jᵀ saves recomputing r-1 GEMMs in the backward pass, for (r-1)·|û|·in_d/out_d memory.
        keep_z = KEEP_Z and ctx.needs_input_grad[0] and not detach_votes
        z_all = u.new_empty(iterations - 1 if keep_z else 0, n_out, batch, d_in, n_in)
        for lo in range(0, batch, chunk):
            ss, cs, zs = _route_chunk(u_t[lo : lo + chunk], w_k, w_flat, iterations)
            s_all[:, :, lo : lo + chunk] = torch.stack(ss)
            if iterations > 1:
                c_all[:, :, lo : lo + chunk] = torch.stack(cs[1:])
                if keep_z:
                    for t, z in enumerate(zs):
                        z_all[t, :, lo : lo + chunk] = z
        ctx.save_for_backward(u_t, w_k, w_flat, s_all, c_all, z_all)
        ctx.config = (iterations, detach_votes, chunk)
        v = squash(s_all[-1]).transpose(0, 1)  # [B, out, out_d]
        c = c_all[-1].permute(1, 2, 0) if iterations > 1 else u.new_full((batch, n_in, n_out), 1.0 / n_out)
        return v.contiguous(), c.contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_v, grad_c):
        u_t, w_k, w_flat, s_all, c_all, z_all = ctx.saved_tensors
        _, detach_votes, chunk = ctx.config
        need_u, need_w = ctx.needs_input_grad[:2]
        if grad_v is None and grad_c is None:
            return None, None, None, None, None
        batch, d_in, n_in = u_t.shape
        n_out, _, d_out = w_k.shape
        if grad_v is None:
            grad_v = u_t.new_zeros(batch, n_out, d_out)
        grad_v = grad_v.transpose(0, 1)  # [out, B, out_d]
        if grad_c is not None:
            grad_c = grad_c.permute(2, 0, 1)  # [out, B, in]
        du = u_t.new_empty(batch, d_in, n_in) if need_u else None
        dw_k = w_k.new_zeros(n_out, d_out, d_in * n_in)  # dL/dW in the [out, out_d, (in_d, in)] layout
        dw_flat = w_k.new_zeros(d_in * n_in, n_out * d_out)  # ... and in the [(in_d, in), (out, out_d)] one
        for lo in range(0, batch, chunk):
            hi = min(lo + chunk, batch)
            ss = list(s_all[:, :, lo:hi].contiguous().unbind(0))
            cs = [None, *c_all[:, :, lo:hi].contiguous().unbind(0)]
            zs = list(z_all[:, :, lo:hi].unbind(0))
            gc = grad_c[:, lo:hi] if grad_c is not None else None
            du_c, dwk, dwf = _backward_chunk(
                u_t[lo:hi], w_k, w_flat, ss, cs, zs, grad_v[:, lo:hi].contiguous(), gc, detach_votes,
                need_u,
            )
            if need_u:
                du[lo:hi] = du_c
            if need_w:
                if dwk is not None:
                    dw_k += dwk
                if dwf is not None:
                    dw_flat += dwf
        grad_u = du.transpose(1, 2) if need_u else None
        grad_w = None
        if need_w:
            grad_w = dw_k.view(n_out, d_out, d_in, n_in).permute(3, 0, 2, 1)
            grad_w = grad_w + dw_flat.view(d_in, n_in, n_out, d_out).permute(1, 2, 0, 3)
        return grad_u, grad_w, None, None, None


def fast_dynamic_routing(
    u: torch.Tensor, weight: torch.Tensor, iterations: int, *, detach_votes: bool = False, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Votes û_j|i = W_ij u_i and Procedure 1 in one step. u [B, in, in_d], W [in, out, in_d, out_d].

    Returns v [B, out, out_d] and the final c [B, in, out], equal to
    ``dynamic_routing(route_votes(weight, u), iterations, detach_votes=detach_votes)``.
    bf16/fp16 inputs (e.g. under autocast) are routed in fp32; the outputs are then fp32.
    """
    dtype = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    if chunk is None:
        chunk = default_chunk(u.shape[0], weight.shape[0], weight.shape[1], weight.shape[2], u.device)
    with torch.autocast(device_type=u.device.type, enabled=False):
        return FastRouting.apply(u.to(dtype), weight.to(dtype), iterations, detach_votes, max(1, int(chunk)))
