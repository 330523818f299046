"""A float64 NumPy transcription, written for these tests, of the math of DeepCaps' Keras layers as the authors'
code (brjathu/deepcaps, capslayers.py) computes it, in their channels-last layout and weight shapes, one image at a
time and with explicit loops over the windows: Conv2DCaps, ConvCapsuleLayer3D with its routing, and the class
CapsuleLayer. tests/test_deepcaps.py feeds capsnet's layers the same inputs and weights."""

from __future__ import annotations

import math

import numpy as np

KERAS_EPS = 1e-7


def same_pads(n: int, k: int, s: int) -> tuple[int, int]:
    """TensorFlow's "same" padding of one side: (before, after)."""
    total = max((math.ceil(n / s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def conv_same(x: np.ndarray, kernel: np.ndarray, stride: int) -> np.ndarray:
    """x [H, W, C_in], kernel [k, k, C_in, C_out] -> [⌈H/s⌉, ⌈W/s⌉, C_out], window by window."""
    h, w, _ = x.shape
    k = kernel.shape[0]
    (t, bt), (lf, rt) = same_pads(h, k, stride), same_pads(w, k, stride)
    xp = np.pad(x, ((t, bt), (lf, rt), (0, 0)))
    oh, ow = math.ceil(h / stride), math.ceil(w / stride)
    out = np.zeros((oh, ow, kernel.shape[3]))
    for y in range(oh):
        for z in range(ow):
            window = xp[y * stride : y * stride + k, z * stride : z * stride + k, :]  # [k, k, C_in]
            out[y, z] = np.einsum("abc,abcd->d", window, kernel)
    return out


def squash(s: np.ndarray, axis, eps: float = 0.0) -> np.ndarray:
    sq = np.sum(s * s, axis=axis, keepdims=True)
    return sq / (1 + sq) * s / np.sqrt(sq + eps)


def conv2d_caps(x: np.ndarray, kernel: np.ndarray, stride: int) -> np.ndarray:
    """Conv2DCaps (r_num = 1): x [H, W, T_in, D_in], kernel [k, k, T_in, D_in, T_out, D_out] ->
    [H', W', T_out, D_out]: one convolution of the T_in·D_in channels, then their squash (ε inside the root)."""
    h, w, t_in, d_in = x.shape
    k, _, _, _, t_out, d_out = kernel.shape
    out = conv_same(x.reshape(h, w, t_in * d_in), kernel.reshape(k, k, t_in * d_in, t_out * d_out), stride)
    return squash(out.reshape(out.shape[0], out.shape[1], t_out, d_out), axis=-1, eps=KERAS_EPS)


def conv_caps_3d(x: np.ndarray, w3: np.ndarray, b: np.ndarray, stride: int, routings: int, *, released: bool):
    """ConvCapsuleLayer3D: x [H, W, T_in, D_in], w3 [D_in, k, k, 1, T_out·D_out], b [T_out, D_out] ->
    [H', W', T_out, D_out]. `released`: the input goes to [T_in·D_in, H, W] by their reshape of the untransposed
    tensor; otherwise by the transpose the paper describes."""
    h, w, t_in, d_in = x.shape
    t_out, d_out = b.shape
    grid = x.reshape(t_in * d_in, h, w) if released else x.transpose(2, 3, 0, 1).reshape(t_in * d_in, h, w)
    # the 3D convolution, depth kernel and stride D_in: one 2D convolution per input type, the kernel shared
    kernel = w3[:, :, :, 0, :].transpose(1, 2, 0, 3)  # [k, k, D_in, T_out·D_out]
    per_type = [conv_same(grid[i * d_in : (i + 1) * d_in].transpose(1, 2, 0), kernel, stride) for i in range(t_in)]
    oh, ow = per_type[0].shape[:2]
    votes = np.stack(per_type).reshape(t_in, oh, ow, t_out, d_out).transpose(0, 3, 4, 1, 2)  # [T_in, T_out, D, H', W']
    logits = np.zeros((t_in, t_out, oh, ow))
    for _ in range(routings):
        flat = logits.reshape(t_in, -1)
        route = np.exp(flat - flat.max(axis=1, keepdims=True))
        route = (route / route.sum(axis=1, keepdims=True)).reshape(logits.shape)  # softmax over T_out, H', W'
        pre = np.einsum("iojk,iodjk->odjk", route, votes) + b[:, :, None, None]  # [T_out, D_out, H', W']
        act = squash(pre, axis=(1, 2, 3))
        logits = logits + np.einsum("iodjk,odjk->iojk", votes, act)
    return act.transpose(2, 3, 0, 1)


def class_capsules(u: np.ndarray, w: np.ndarray, bias: np.ndarray, routings: int) -> np.ndarray:
    """CapsuleLayer (channels = 0): u [I, d], w [J, I, D, d], bias [J, D] -> [J, D]."""
    u_hat = np.einsum("jied,id->jie", w, u)  # [J, I, D]
    b = np.zeros(w.shape[:2])
    for r in range(routings):
        c = np.exp(b - b.max(axis=0, keepdims=True))
        c = c / c.sum(axis=0, keepdims=True)  # softmax over the classes
        out = squash(np.einsum("ji,jie->je", c, u_hat) + bias, axis=-1)
        if r < routings - 1:
            b = b + np.einsum("je,jie->ji", out, u_hat)
    return out
