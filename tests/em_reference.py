"""A literal loop reference of EM routing (Hinton, Sabour & Frosst 2018, Procedure 1), one image at a time, in
float64: every parent and every child is a Python loop iteration; R is a dict keyed by (parent, child).

It uses the library's stated choices (λ_t = λ_final (1 − 0.95^(t+1)), σ² floor, Gritzman's data normalisation
100 J / I, R normalised over every parent a child reaches, last E-step skipped) but none of its code.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

MIN_VAR = 5e-4
TINY = 1e-8


def em_loops(votes, acts, fields, n_types, beta_u, beta_a, *, iterations, final_lambda=0.01):
    """votes[(pos, j, child)] -> [16]; acts[child] -> scalar; fields[pos] -> list of the children in the field of
    the parents at `pos`. Returns (mu, a): dicts keyed by parent (pos, j)."""
    reach = defaultdict(list)  # child -> the parents (pos, j) it reaches
    for pos, children in fields.items():
        for child in children:
            for j in range(n_types):
                reach[child].append((pos, j))
    R = {}
    for child, parents in reach.items():
        for parent in parents:
            R[parent, child] = 1.0 / len(parents)  # uniform over the parents i reaches
    for it in range(iterations):
        lam = final_lambda * (1.0 - 0.95 ** (it + 1))
        mu, var, a = {}, {}, {}
        for pos, children in fields.items():  # M-step, one parent at a time
            scale = 100.0 * n_types / len(children)
            for j in range(n_types):
                rp = [R[(pos, j), c] * acts[c] for c in children]  # R_ij a_i
                mass = sum(rp) + TINY
                m = sum(r * votes[pos, j, c] for r, c in zip(rp, children)) / mass
                v = sum(r * (votes[pos, j, c] - m) ** 2 for r, c in zip(rp, children)) / mass + MIN_VAR
                cost = (beta_u[j] + 0.5 * torch.log(v)) * mass * scale  # (β_u + log σ_h) Σ_i R_ij
                a[pos, j] = torch.sigmoid(lam * (beta_a[j] - cost.sum()))
                mu[pos, j], var[pos, j] = m, v
        if it == iterations - 1:
            break
        for child, parents in reach.items():  # E-step, one child at a time
            z = []
            for pos, j in parents:
                d = votes[pos, j, child] - mu[pos, j]
                log_p = -(d * d / (2 * var[pos, j])).sum() - 0.5 * torch.log(2 * math.pi * var[pos, j]).sum()
                z.append(torch.log(a[pos, j]) + log_p)
            lse = torch.logsumexp(torch.stack(z), dim=0)
            for parent, zp in zip(parents, z):
                R[parent, child] = torch.exp(zp - lse)
    return mu, a


def conv_caps_reference(poses, acts, weight, beta_u, beta_a, *, kernel_size, stride, iterations):
    """One image: poses [H, W, T, 16], acts [H, W, T], weight [J, K·K·T, 4, 4] (slot = (dy·K + dx)·T + t).
    Returns (poses [H', W', J, 16], activations [H', W', J])."""
    h, w, t = acts.shape
    n_out = weight.shape[0]
    oh, ow = (h - kernel_size) // stride + 1, (w - kernel_size) // stride + 1
    fields, votes, a_in = {}, {}, {}
    for y in range(oh):
        for x in range(ow):
            children = []
            for dy in range(kernel_size):
                for dx in range(kernel_size):
                    for c in range(t):
                        child = (y * stride + dy, x * stride + dx, c)
                        slot = (dy * kernel_size + dx) * t + c
                        children.append(child)
                        a_in[child] = acts[child]
                        m = poses[child].reshape(4, 4)
                        for j in range(n_out):
                            votes[(y, x), j, child] = (m @ weight[j, slot]).reshape(16)  # V_ij = M_i W_ij
            fields[y, x] = children
    mu, a = em_loops(votes, a_in, fields, n_out, beta_u, beta_a, iterations=iterations)
    out_mu = torch.stack([torch.stack([torch.stack([mu[(y, x), j] for j in range(n_out)]) for x in range(ow)])
                          for y in range(oh)])  # fmt: skip
    out_a = torch.stack([torch.stack([torch.stack([a[(y, x), j] for j in range(n_out)]) for x in range(ow)])
                         for y in range(oh)])  # fmt: skip
    return out_mu, out_a


def class_caps_reference(poses, acts, weight, beta_u, beta_a, centres, *, iterations):
    """One image: poses [H, W, T, 16], acts [H, W, T], weight [n, T, 4, 4], centres [H·W, 2] or None.
    Returns (poses [n, 16], activations [n])."""
    h, w, t = acts.shape
    n_out = weight.shape[0]
    votes, a_in, children = {}, {}, []
    for y in range(h):
        for x in range(w):
            for c in range(t):
                child = (y, x, c)
                children.append(child)
                a_in[child] = acts[child]
                for j in range(n_out):
                    v = poses[child].reshape(4, 4) @ weight[j, c]
                    if (
                        centres is not None
                    ):  # coordinate addition: centres[:, 0] into V[0, 3], centres[:, 1] into V[1, 3]
                        v = v + torch.zeros_like(v).index_put((torch.tensor([0, 1]), torch.tensor([3, 3])),
                                                              centres[y * w + x])  # fmt: skip
                    votes[0, j, child] = v.reshape(16)
    mu, a = em_loops(votes, a_in, {0: children}, n_out, beta_u, beta_a, iterations=iterations)
    return torch.stack([mu[0, j] for j in range(n_out)]), torch.stack([a[0, j] for j in range(n_out)])
