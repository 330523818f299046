"""A literal, loop-by-loop float64 implementation of Procedure 1 — the specification `Router` is tested against.

Nothing here is vectorized: every index of the paper's algorithm is a Python loop, so it can be read
line by line against the paper.
"""

from __future__ import annotations

import math

import torch


def squash_vector(s: list[float], eps: float = 1e-8) -> list[float]:
    """Eq. 1 for one vector, with the same eps inside the root as capsnet.squash."""
    sq = sum(x * x for x in s)
    scale = sq / (1.0 + sq) / math.sqrt(sq + eps)
    return [scale * x for x in s]


def procedure1(weight: torch.Tensor, u: torch.Tensor, iterations: int) -> tuple[list, list]:
    """Returns v[b][j] (lists of floats) and the final c[b][i][j]."""
    n_in, n_out, d_in, d_out = weight.shape
    W = weight.double().tolist()
    U = u.double().tolist()
    all_v, all_c = [], []
    for b in range(len(U)):
        # û_j|i = W_ij u_i  (W_ij is d_in × d_out: û_m = Σ_n u_n W_nm)
        u_hat = [
            [[sum(U[b][i][n] * W[i][j][n][m] for n in range(d_in)) for m in range(d_out)] for j in range(n_out)]
            for i in range(n_in)
        ]
        logits = [[0.0] * n_out for _ in range(n_in)]  # b_ij ← 0
        for _ in range(iterations):
            c = []
            for i in range(n_in):  # c_i ← softmax(b_i), over the output capsules j
                z = max(logits[i])
                e = [math.exp(x - z) for x in logits[i]]
                c.append([x / sum(e) for x in e])
            v = []
            for j in range(n_out):  # s_j ← Σ_i c_ij û_j|i ; v_j ← squash(s_j)
                s = [sum(c[i][j] * u_hat[i][j][m] for i in range(n_in)) for m in range(d_out)]
                v.append(squash_vector(s))
            for i in range(n_in):  # b_ij ← b_ij + û_j|i · v_j
                for j in range(n_out):
                    logits[i][j] += sum(u_hat[i][j][m] * v[j][m] for m in range(d_out))
        all_v.append(v)
        all_c.append(c)
    return all_v, all_c
