"""Literal, element-by-element transcriptions of the routing procedures of issue 14: the specifications the
vectorized layers in capsnet.routing are tested against.

Every index of each paper's procedure is a Python loop over scalar tensor operations (float64, differentiable,
so gradients can be compared too). Slow by design: use a handful of capsules.
"""

from __future__ import annotations

import math

import torch


def _softmax(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    z = max(x.item() for x in xs)
    e = [torch.exp(x - z) for x in xs]
    total = sum(e)
    return [x / total for x in e]


def _vote(w: torch.Tensor, p: list[torch.Tensor], d_in: int, d_out: int) -> list[torch.Tensor]:
    """û_m = Σ_n p_n W_nm  (W is d_in × d_out)."""
    return [sum(p[n] * w[n, m] for n in range(d_in)) for m in range(d_out)]


def _matrix_vote(w: torch.Tensor, p: list[torch.Tensor], side: int) -> list[torch.Tensor]:
    """V = W · P for √d×√d matrices, P read row-major from the pose vector."""
    return [sum(w[r, k] * p[k * side + c] for k in range(side)) for r in range(side) for c in range(side)]


def self_attention(weight: torch.Tensor, prior: torch.Tensor, u: torch.Tensor, eps: float = 1e-8):
    """Efficient-CapsNet's self-attention routing. Returns v [B, J, M] and c [B, I, J] as tensors."""
    n_in, n_out, d_in, d_out = weight.shape
    all_v, all_c = [], []
    for b in range(u.shape[0]):
        p = [[u[b, i, n] for n in range(d_in)] for i in range(n_in)]
        u_hat = [[_vote(weight[i, j], p[i], d_in, d_out) for j in range(n_out)] for i in range(n_in)]  # û_ij = W_ij u_i
        logit = [[None] * n_out for _ in range(n_in)]
        for j in range(n_out):  # A_j = Û_j Û_jᵀ / √d; the coupling logit of child i is the row sum Σ_k A_j[i, k]
            A = [[sum(u_hat[i][j][m] * u_hat[k][j][m] for m in range(d_out)) / math.sqrt(d_out)
                  for k in range(n_in)] for i in range(n_in)]  # fmt: skip
            for i in range(n_in):
                logit[i][j] = sum(A[i][k] for k in range(n_in))
        c = [_softmax(logit[i]) for i in range(n_in)]  # c_ij = softmax over the parents j
        v = []
        for j in range(n_out):  # s_j = Σ_i û_ij (c_ij + b_ij); v_j = (1 − e^{−|s|}) s / |s|
            s = [sum(u_hat[i][j][m] * (c[i][j] + prior[i, j]) for i in range(n_in)) for m in range(d_out)]
            norm = torch.sqrt(sum(x * x for x in s) + eps)
            v.append(torch.stack([(1 - torch.exp(-norm)) * x / norm for x in s]))
        all_v.append(torch.stack(v))
        all_c.append(torch.stack([torch.stack(row) for row in c]))
    return torch.stack(all_v), torch.stack(all_c)


def _layer_norm(s: list[torch.Tensor], gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5):
    mean = sum(s) / len(s)
    var = sum((x - mean) ** 2 for x in s) / len(s)
    return [gamma[m] * (x - mean) / torch.sqrt(var + eps) + beta[m] for m, x in enumerate(s)]


def inverted_attention_pass(weight, gamma, beta, children, parents, *, matrix_pose=False, scale=1.0):
    """One pass of Procedure 1 (Tsai et al. 2020) for one example: children [I][d] (lists of scalars), the parents'
    poses [J][d] or None (p_j = 0). Returns (new parent poses [J][d], r [I][J])."""
    n_in, n_out = weight.shape[:2]
    d = len(children[0])
    side = weight.shape[-1]
    v = [[_matrix_vote(weight[i, j], children[i], side) if matrix_pose
          else _vote(weight[i, j], children[i], d, weight.shape[3]) for j in range(n_out)]
         for i in range(n_in)]  # Eq. 1: v_ij = W_ij · p_i  # fmt: skip
    d_out = len(v[0][0])
    r = []
    for i in range(n_in):  # Eq. 2: a_ij = p_jᵀ v_ij (0 when p_j = 0);  Eq. 3: r_ij = softmax over j
        a = [sum(parents[j][m] * v[i][j][m] for m in range(d_out)) * scale if parents is not None
             else torch.zeros((), dtype=weight.dtype) for j in range(n_out)]  # fmt: skip
        r.append(_softmax(a))
    new = []
    for j in range(n_out):  # Eq. 4: p_j = LayerNorm(Σ_i r_ij v_ij)
        s = [sum(r[i][j] * v[i][j][m] for i in range(n_in)) for m in range(d_out)]
        new.append(_layer_norm(s, gamma, beta))
    return new, r


def _rows(x: torch.Tensor) -> list[list[torch.Tensor]]:
    return [[x[i, m] for m in range(x.shape[1])] for i in range(x.shape[0])]


def _tensor(rows) -> torch.Tensor:
    return torch.stack([torch.stack(row) for row in rows])


def inverted_attention(weight, gamma, beta, u, iterations, *, matrix_pose=False, scale=1.0):
    """Sequential routing of one fully connected layer: `iterations` passes from p = 0. Returns p, r tensors."""
    out_p, out_r = [], []
    for b in range(u.shape[0]):
        parents = None
        for _ in range(iterations):
            parents, r = inverted_attention_pass(weight, gamma, beta, _rows(u[b]), parents,
                                                 matrix_pose=matrix_pose, scale=scale)  # fmt: skip
        out_p.append(_tensor(parents))
        out_r.append(_tensor(r))
    return torch.stack(out_p), torch.stack(out_r)


def concurrent(layers, u, iterations):
    """Concurrent routing (Tsai et al. §2.2) through fully connected layers given as (weight, gamma, beta).
    Iteration 1: one uniform pass up the stack; iteration t: every layer from iteration t−1's poses."""
    outs = []
    for b in range(u.shape[0]):
        poses, x = [], _rows(u[b])
        for w, g, bt in layers:
            x, _ = inverted_attention_pass(w, g, bt, x, None)
            poses.append(x)
        for _ in range(iterations - 1):
            below = [_rows(u[b]), *poses[:-1]]
            poses = [inverted_attention_pass(w, g, bt, below[k], poses[k])[0] for k, (w, g, bt) in enumerate(layers)]
        outs.append([_tensor(p) for p in poses])
    return [torch.stack([o[k] for o in outs]) for k in range(len(layers))]


def inverted_attention_conv(weight, gamma, beta, u, kernel, stride, parents=None, *, matrix_pose=True):
    """One pass of a convolutional layer: u [B, T, H, W, d]; the children of output location (y, x) are the
    capsules of every type t at (y·s + ky, x·s + kx), child index t·k² + ky·k + kx. parents [B, T', H', W', d]."""
    b_n, t_n, h, w_n, d = u.shape
    ho, wo = (h - kernel) // stride + 1, (w_n - kernel) // stride + 1
    out = []
    for b in range(b_n):
        grid = []
        for y in range(ho):
            row = []
            for x in range(wo):
                children = [[u[b, t, y * stride + ky, x * stride + kx, m] for m in range(d)]
                            for t in range(t_n) for ky in range(kernel) for kx in range(kernel)]  # fmt: skip
                par = None if parents is None else _rows(parents[b, :, y, x])
                p, _ = inverted_attention_pass(weight, gamma, beta, children, par, matrix_pose=matrix_pose)
                row.append(_tensor(p))  # [T', d]
            grid.append(torch.stack(row))
        out.append(torch.stack(grid).permute(2, 0, 1, 3))  # [T', H', W', d]
    return torch.stack(out)


def self_routing(pose_weight, route_weight, route_bias, u, a, eps=1e-8, *, matrix_pose=False):
    """Self-routing (Hahn et al. 2019) of a fully connected layer. Returns poses [B, J, M], a_out [B, J], c."""
    n_in, n_out = pose_weight.shape[:2]
    d_in = u.shape[2]
    d_out = d_in if matrix_pose else pose_weight.shape[3]
    all_p, all_a, all_c = [], [], []
    for b in range(u.shape[0]):
        p = [[u[b, i, n] for n in range(d_in)] for i in range(n_in)]
        # c_ij = softmax_j(W^route_i u_i + b_i)
        c = [_softmax([sum(p[i][n] * route_weight[i, n, j] for n in range(d_in)) + route_bias[i, j]
                       for j in range(n_out)]) for i in range(n_in)]  # fmt: skip
        side = pose_weight.shape[-1]
        u_hat = [[_matrix_vote(pose_weight[i, j], p[i], side) if matrix_pose
                  else _vote(pose_weight[i, j], p[i], d_in, d_out) for j in range(n_out)]
                 for i in range(n_in)]  # fmt: skip
        a_sum = sum(a[b, i] for i in range(n_in))
        poses, acts = [], []
        for j in range(n_out):
            weight_sum = sum(c[i][j] * a[b, i] for i in range(n_in))
            acts.append(weight_sum / (a_sum + eps))  # a_j = Σ_i c_ij a_i / Σ_i a_i
            poses.append(torch.stack([sum(c[i][j] * a[b, i] * u_hat[i][j][m] for i in range(n_in)) / (weight_sum + eps)
                                      for m in range(d_out)]))  # u_j = Σ_i c_ij a_i û_j|i / Σ_i c_ij a_i  # fmt: skip
        all_p.append(torch.stack(poses))
        all_a.append(torch.stack(acts))
        all_c.append(_tensor(c))
    return torch.stack(all_p), torch.stack(all_a), torch.stack(all_c)
