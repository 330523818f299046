"""Triton kernels of dynamic routing (Procedure 1 of Sabour, Frosst & Hinton 2017), forward and backward.

Imported only through `capsnet.routing.dynamic_triton` (Triton is optional). Shapes as in csrc/routing_cpu.cpp:
u [B, I, N] input capsules, W [I, J, N, M], votes û_ij = W_ijᵀ u_i (Eq. 2) [I, J, M] per sample. A program of a
pass handles BB samples and one slice of the input capsules, BI capsules at a time, in tiles [BB, BI, BJ, BM] (BJ,
BM: J and M rounded up to powers of two, masked): the votes of a tile are formed in registers from u and W (N
multiply-adds each) and used there, never written to memory. The routing logits need no memory either: every pass
adds û · v to them, so b_t,ij = û_ij · V_t,j with V_t = Σ_{t'<t} v_t' [J, M] per sample (b_0 = 0).

A sum over all input capsules (s_t = Σ_i c_t û forward, dV_t = Σ_i db_t û backward) ends a pass: each program
stores its slice's partial sum, and the next launch adds the partial sums in slice order (the results do not depend
on scheduling). Launches: r + 1 forward; r + 1 backward, plus torch's sum of the weight gradient's batch chunks.

Backward (csrc/routing_cpu.cpp's derivation, with the per-pass db_t = dL/db_t):
  ds_{r-1} = squash'(s_{r-1})ᵀ dv;  for t = r-1 … 1:  dc = û · ds_t (+ dL/dc at t = r-1),
  db_t = c_t ⊙ (dc − Σ_j c_t dc),  dV_t = Σ_i db_t û,  ds_{t-1} = squash'(s_{t-1})ᵀ Σ_{t'' ≥ t} dV_t'';
  dû_ij = (1/J) ds_0,j + Σ_{t ≥ 1} (c_t,ij ds_t,j + db_t,ij V_t,j)   (detach_votes: c_{r-1} ds_{r-1} only);
  dL/du_i = Σ_j W_ij dû_ij,  dL/dW_ij = Σ_b u_bi ⊗ dû_bij.
"""

from __future__ import annotations

import triton
import triton.language as tl

EPS = 1e-8  # inside the squash's square root, as capsnet.nn.squash


@triton.jit
def _squash(s, EPS: tl.constexpr):
    """Eq. 1 over the last axis of s [BB, BJ, BM]: v = s · q / ((1 + q) · sqrt(q + eps)), q = |s|²."""
    q = tl.sum(s * s, axis=2)
    return s * (q / ((1.0 + q) * tl.sqrt(q + EPS)))[:, :, None]


@triton.jit
def _squash_backward(s, dv, EPS: tl.constexpr):
    """dL/ds for v = s·f(q):  f·dv + 2 f'(q) (s·dv) s,  f = q·g,  g = 1/((1+q) sqrt(q+eps)),
    f' = g (1 − q/(1+q) − q/(2(q+eps)))."""
    q = tl.sum(s * s, axis=2)
    sd = tl.sum(s * dv, axis=2)
    g = 1.0 / ((1.0 + q) * tl.sqrt(q + EPS))
    fp = g * (1.0 - q / (1.0 + q) - 0.5 * q / (q + EPS))
    return dv * (q * g)[:, :, None] + s * (2.0 * fp * sd)[:, :, None]


@triton.jit
def _votes(
    u_ptr,
    w_ptr,
    b4,
    i4,
    j4,
    m4,
    hi,
    B,
    I,
    J,
    M,
    N: tl.constexpr,
    BB: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    BM: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Eq. 2 for a tile: û[b, i, j, m] = Σ_n u[b, i, n] W[i, j, n, m]  [BB, BI, BJ, BM] (0 where masked: b ≥ B,
    i ≥ hi, j ≥ J, m ≥ M)."""
    mask_u = (b4 < B) & (i4 < hi)
    mask_w = (i4 < hi) & (j4 < J) & (m4 < M)
    uh = tl.zeros((BB, BI, BJ, BM), dtype=DTYPE)
    for n in tl.static_range(N):
        un = tl.load(u_ptr + (b4 * I + i4) * N + n, mask=mask_u, other=0.0)  # [BB, BI, 1, 1]
        wn = tl.load(w_ptr + ((i4 * J + j4) * N + n) * M + m4, mask=mask_w, other=0.0)  # [1, BI, BJ, BM]
        uh += un * wn
    return uh


@triton.jit
def _slices_sum(
    part_ptr,
    t,
    n_split,
    b3,
    j3,
    m3,
    mask,
    B,
    J,
    M,
    BB: tl.constexpr,
    BJ: tl.constexpr,
    BM: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Σ over the slices of pass t's partial sums part[t, slice, b, j, m]  [BB, BJ, BM], in slice order."""
    total = tl.zeros((BB, BJ, BM), dtype=DTYPE)
    for k in range(n_split):
        total += tl.load(part_ptr + (((t * n_split + k) * B + b3) * J + j3) * M + m3, mask=mask, other=0.0)
    return total


@triton.jit(do_not_specialize=["t", "B"])
def forward_pass(
    u_ptr,
    w_ptr,
    part_ptr,
    c_ptr,
    s_ptr,
    v_ptr,
    t,
    B,
    I,
    J,
    M,
    n_split,
    slice_len,
    N: tl.constexpr,
    R: tl.constexpr,
    BB: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    BM: tl.constexpr,
    DTYPE: tl.constexpr,
    EPS: tl.constexpr,
):
    """Pass t of Procedure 1 for BB samples and the input capsules [slice·slice_len, (slice+1)·slice_len):
    c_t = softmax_j(û · V_t) (stored for t ≥ 1 in c_all[t-1, b, i, j]) and this slice's part of s_t = Σ_i c_t û
    (part[t, slice, b]). The slice-0 programs store s_{t-1}, the previous pass's partial sums added, in
    s_all[b, t-1]. Launched last with t = R and no capsules: s_{R-1} and v = squash(s_{R-1}) [B, J, M]."""
    pid_b, split = tl.program_id(0), tl.program_id(1)
    offs_b = pid_b * BB + tl.arange(0, BB)
    offs_j, offs_m = tl.arange(0, BJ), tl.arange(0, BM)
    b3, j3, m3 = offs_b[:, None, None], offs_j[None, :, None], offs_m[None, None, :]  # a [BB, BJ, BM] tile
    mask3 = (b3 < B) & (j3 < J) & (m3 < M)
    V = tl.zeros((BB, BJ, BM), dtype=DTYPE)  # V_t = Σ_{t' < t} v_t'
    for tp in range(t):
        s_prev = _slices_sum(part_ptr, tp, n_split, b3, j3, m3, mask3, B, J, M, BB, BJ, BM, DTYPE)
        v_prev = _squash(s_prev, EPS)
        V += v_prev
        last = (split == 0) & (tp == t - 1)
        tl.store(s_ptr + ((b3 * R + tp) * J + j3) * M + m3, s_prev, mask=mask3 & last)
        tl.store(v_ptr + (b3 * J + j3) * M + m3, v_prev, mask=mask3 & last & (t == R))
    b4, j4, m4 = offs_b[:, None, None, None], offs_j[None, None, :, None], offs_m[None, None, None, :]
    b_c, j_c = offs_b[:, None, None], offs_j[None, None, :]  # a [BB, BI, BJ] tile
    V4 = V[:, None, :, :]
    acc = tl.zeros((BB, BJ, BM), dtype=DTYPE)
    lo = split * slice_len
    hi = tl.minimum(lo + slice_len, I)
    for i0 in range(lo, hi, BI):
        offs_i = i0 + tl.arange(0, BI)
        uh = _votes(u_ptr, w_ptr, b4, offs_i[None, :, None, None], j4, m4, hi, B, I, J, M, N, BB, BI, BJ, BM, DTYPE)
        logits = tl.where(j_c < J, tl.sum(uh * V4, axis=3), float("-inf"))  # b_t,ij = û_ij · V_t,j  [BB, BI, BJ]
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        c = e / tl.sum(e, axis=2)[:, :, None]  # Eq. 3: c_ij = softmax_j(b_ij); 1/J at t = 0
        i_c = offs_i[None, :, None]
        c_off = ((tl.maximum(t - 1, 0) * B + b_c) * I + i_c) * J + j_c
        tl.store(c_ptr + c_off, c, mask=(b_c < B) & (i_c < hi) & (j_c < J) & (t > 0))
        acc += tl.sum(c[:, :, :, None] * uh, axis=1)  # s_j = Σ_i c_ij û_j|i over the slice  [BB, BJ, BM]
    tl.store(part_ptr + (((t * n_split + split) * B + b3) * J + j3) * M + m3, acc, mask=mask3 & (t < R))


@triton.jit(do_not_specialize=["t", "B"])
def backward_pass(
    u_ptr,
    w_ptr,
    s_ptr,
    c_ptr,
    gv_ptr,
    gc_ptr,
    dvp_ptr,
    g_ptr,
    ds_ptr,
    t,
    B,
    I,
    J,
    M,
    n_split,
    slice_len,
    N: tl.constexpr,
    R: tl.constexpr,
    BB: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    BM: tl.constexpr,
    HAS_GV: tl.constexpr,
    HAS_GC: tl.constexpr,
    DTYPE: tl.constexpr,
    EPS: tl.constexpr,
):
    """Pass t ≥ 1 backwards for BB samples and one slice of input capsules: ds_t (stored in ds_all[b, t] by the
    slice-0 programs), db_t = c_t ⊙ (dc − Σ_j c_t dc) with dc = û · ds_t (+ dL/dc at t = R-1), stored in
    g_all[t-1, b, i, j], and this slice's part of dV_t = Σ_i db_t û (dv_part[t, slice, b])."""
    pid_b, split = tl.program_id(0), tl.program_id(1)
    offs_b = pid_b * BB + tl.arange(0, BB)
    offs_j, offs_m = tl.arange(0, BJ), tl.arange(0, BM)
    b3, j3, m3 = offs_b[:, None, None], offs_j[None, :, None], offs_m[None, None, :]
    mask3 = (b3 < B) & (j3 < J) & (m3 < M)
    dv = tl.zeros((BB, BJ, BM), dtype=DTYPE)  # dL/dv_t: dL/dv at t = R-1, else Σ_{t'' > t} dV_t''
    if HAS_GV:
        dv += tl.load(gv_ptr + (b3 * J + j3) * M + m3, mask=mask3 & (t == R - 1), other=0.0)
    for tpp in range(t + 1, R):
        dv += _slices_sum(dvp_ptr, tpp, n_split, b3, j3, m3, mask3, B, J, M, BB, BJ, BM, DTYPE)
    s_t = tl.load(s_ptr + ((b3 * R + t) * J + j3) * M + m3, mask=mask3, other=0.0)
    ds = _squash_backward(s_t, dv, EPS)  # dL/ds_t  [BB, BJ, BM]
    tl.store(ds_ptr + ((b3 * R + t) * J + j3) * M + m3, ds, mask=mask3 & (split == 0))
    b4, j4, m4 = offs_b[:, None, None, None], offs_j[None, None, :, None], offs_m[None, None, None, :]
    b_c, j_c = offs_b[:, None, None], offs_j[None, None, :]
    ds4 = ds[:, None, :, :]
    acc = tl.zeros((BB, BJ, BM), dtype=DTYPE)
    lo = split * slice_len
    hi = tl.minimum(lo + slice_len, I)
    for i0 in range(lo, hi, BI):
        offs_i = i0 + tl.arange(0, BI)
        uh = _votes(u_ptr, w_ptr, b4, offs_i[None, :, None, None], j4, m4, hi, B, I, J, M, N, BB, BI, BJ, BM, DTYPE)
        i_c = offs_i[None, :, None]
        off = (((t - 1) * B + b_c) * I + i_c) * J + j_c  # [BB, BI, BJ] in c_all and g_all
        mask_c = (b_c < B) & (i_c < hi) & (j_c < J)
        c = tl.load(c_ptr + off, mask=mask_c, other=0.0)
        dc = tl.sum(uh * ds4, axis=3)  # dc_ij = û_ij · ds_t,j
        if HAS_GC:
            dc += tl.load(gc_ptr + (b_c * I + i_c) * J + j_c, mask=mask_c & (t == R - 1), other=0.0)
        db = c * (dc - tl.sum(c * dc, axis=2)[:, :, None])  # softmax backward over j
        tl.store(g_ptr + off, db, mask=mask_c)
        acc += tl.sum(db[:, :, :, None] * uh, axis=1)  # dV_t = Σ_i db_t,ij û_ij
    tl.store(dvp_ptr + (((t * n_split + split) * B + b3) * J + j3) * M + m3, acc, mask=mask3)


@triton.jit(do_not_specialize=["B"])
def backward_finish(
    s_ptr,
    gv_ptr,
    dvp_ptr,
    ds_ptr,
    vs_ptr,
    B,
    J,
    M,
    n_split,
    R: tl.constexpr,
    BB: tl.constexpr,
    BJ: tl.constexpr,
    BM: tl.constexpr,
    HAS_GV: tl.constexpr,
    THROUGH: tl.constexpr,
    DTYPE: tl.constexpr,
    EPS: tl.constexpr,
):
    """Through the routing (r > 1, votes not detached): ds_0 from dV_1 … dV_{R-1}; else ds_{R-1} from dL/dv; both in
    ds_all[b, t]. And V_t = Σ_{t' < t} squash(s_t') for every pass, in vsum[b, t]."""
    offs_b = tl.program_id(0) * BB + tl.arange(0, BB)
    b3 = offs_b[:, None, None]
    j3, m3 = tl.arange(0, BJ)[None, :, None], tl.arange(0, BM)[None, None, :]
    mask3 = (b3 < B) & (j3 < J) & (m3 < M)
    dv = tl.zeros((BB, BJ, BM), dtype=DTYPE)
    if THROUGH:
        for t in range(1, R):
            dv += _slices_sum(dvp_ptr, t, n_split, b3, j3, m3, mask3, B, J, M, BB, BJ, BM, DTYPE)
        t_ds = 0
    else:
        if HAS_GV:
            dv += tl.load(gv_ptr + (b3 * J + j3) * M + m3, mask=mask3, other=0.0)
        t_ds = R - 1
    s = tl.load(s_ptr + ((b3 * R + t_ds) * J + j3) * M + m3, mask=mask3, other=0.0)
    tl.store(ds_ptr + ((b3 * R + t_ds) * J + j3) * M + m3, _squash_backward(s, dv, EPS), mask=mask3)
    V = tl.zeros((BB, BJ, BM), dtype=DTYPE)
    for t in tl.static_range(R):
        tl.store(vs_ptr + ((b3 * R + t) * J + j3) * M + m3, V, mask=mask3)
        V += _squash(tl.load(s_ptr + ((b3 * R + t) * J + j3) * M + m3, mask=mask3, other=0.0), EPS)


@triton.jit(do_not_specialize=["B", "chunk"])
def grad_inputs(
    u_ptr,
    w_ptr,
    c_ptr,
    g_ptr,
    ds_ptr,
    vs_ptr,
    du_ptr,
    dwp_ptr,
    B,
    I,
    J,
    M,
    chunk,
    N: tl.constexpr,
    R: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    THROUGH: tl.constexpr,
    NEED_U: tl.constexpr,
    NEED_W: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """For BI input capsules and one chunk of samples: dû_bij from its factors (the top of the file), then
    dL/du_bi = Σ_j W_ij dû_bij (du [B, I, N]) and this chunk's Σ_b u_bi ⊗ dû_bij (dw_part[chunk, i, j, n, m])."""
    pid_i, pid_c = tl.program_id(0), tl.program_id(1)
    offs_i = pid_i * BI + tl.arange(0, BI)
    offs_j, offs_n, offs_m = tl.arange(0, BJ), tl.arange(0, BN), tl.arange(0, BM)
    i4, j4 = offs_i[:, None, None, None], offs_j[None, :, None, None]
    n4, m4 = offs_n[None, None, :, None], offs_m[None, None, None, :]
    mask4 = (i4 < I) & (j4 < J) & (n4 < N) & (m4 < M)
    w = tl.load(w_ptr + ((i4 * J + j4) * N + n4) * M + m4, mask=mask4, other=0.0)  # W_i  [BI, BJ, BN, BM]
    acc = tl.zeros((BI, BJ, BN, BM), dtype=DTYPE)
    i2, j2, n2 = offs_i[:, None], offs_j[None, :], offs_n[None, :]
    mask_ij = (i2 < I) & (j2 < J)
    j3, m3 = offs_j[None, :, None], offs_m[None, None, :]
    mask_jm = (j3 < J) & (m3 < M)
    lo = pid_c * chunk
    hi = tl.minimum(lo + chunk, B)
    for b in range(lo, hi):
        if THROUGH:
            dh = tl.load(ds_ptr + ((b * R) * J + j3) * M + m3, mask=mask_jm, other=0.0) / J  # [1, BJ, BM]
            for t in tl.static_range(1, R):
                c = tl.load(c_ptr + (((t - 1) * B + b) * I + i2) * J + j2, mask=mask_ij, other=0.0)  # [BI, BJ]
                g = tl.load(g_ptr + (((t - 1) * B + b) * I + i2) * J + j2, mask=mask_ij, other=0.0)
                ds_t = tl.load(ds_ptr + ((b * R + t) * J + j3) * M + m3, mask=mask_jm, other=0.0)
                v_t = tl.load(vs_ptr + ((b * R + t) * J + j3) * M + m3, mask=mask_jm, other=0.0)
                dh = dh + c[:, :, None] * ds_t + g[:, :, None] * v_t  # [BI, BJ, BM]
        elif R == 1:
            dh = tl.load(ds_ptr + (b * J + j3) * M + m3, mask=mask_jm, other=0.0) / J
        else:  # detach_votes: s_{R-1} = Σ_i c_{R-1} û is the only use of û with a gradient
            c = tl.load(c_ptr + (((R - 2) * B + b) * I + i2) * J + j2, mask=mask_ij, other=0.0)
            dh = c[:, :, None] * tl.load(ds_ptr + ((b * R + R - 1) * J + j3) * M + m3, mask=mask_jm, other=0.0)
        dh = dh + tl.zeros((BI, BJ, BM), dtype=DTYPE)
        if NEED_U:
            du = tl.sum(tl.sum(w * dh[:, :, None, :], axis=3), axis=1)  # Σ_(j,m) W_ijnm dû_ijm  [BI, BN]
            tl.store(du_ptr + (b * I + i2) * N + n2, du, mask=(i2 < I) & (n2 < N))
        if NEED_W:
            un = tl.load(u_ptr + (b * I + i2) * N + n2, mask=(i2 < I) & (n2 < N), other=0.0)  # [BI, BN]
            acc += un[:, None, :, None] * dh[:, :, None, :]
    if NEED_W:
        tl.store(dwp_ptr + pid_c * I * J * N * M + ((i4 * J + j4) * N + n4) * M + m4, acc, mask=mask4)
