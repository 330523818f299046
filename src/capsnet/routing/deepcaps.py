"""DeepCaps' convolutional capsule layers (Rajasegaran et al., "DeepCaps: Going Deeper with Capsule Networks",
CVPR 2019, §3): `ConvCaps2D`, a convolution over capsule grids followed by the squash (no routing), and
`ConvCaps3D`, the 3D-convolution votes with the paper's 3D dynamic routing (Algorithm 1).

A capsule grid is [B, T, D, H, W]: T capsule types of D dimensions at each of H×W positions (channel t·D + d of
the convolution that made it). Padding is TensorFlow's "same" (the authors' Keras layers): for stride s the output
side is ⌈H/s⌉ and the padding is split with the odd pixel at the bottom / right.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.squash import squash

KERAS_EPS = 1e-7  # Keras's backend ε, inside the authors' squash of ConvCaps2D


def same_padding(x: torch.Tensor, kernel_size: int, stride: int) -> torch.Tensor:
    """Zero-pad x [N, C, H, W] as TensorFlow's "same": total max((⌈n/s⌉ − 1)·s + k − n, 0) per side pair, the
    larger half after the image."""
    pads = []
    for n in (x.shape[-1], x.shape[-2]):  # F.pad takes the last dimension first
        total = max((math.ceil(n / stride) - 1) * stride + kernel_size - n, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


def glorot_uniform_(tensor: torch.Tensor, fan_in: float, fan_out: float) -> torch.Tensor:
    """Keras's default kernel initialiser: uniform in ±√(6 / (fan_in + fan_out))."""
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return nn.init.uniform_(tensor, -bound, bound)


class ConvCaps2D(nn.Module):
    """§3.1: a k×k convolution of the T_in·D_in channels of a capsule grid into T_out·D_out, without bias, then the
    squash of each D_out-vector: v = |s|²/(1 + |s|²) · s/√(|s|² + 1e-7).

    Parameters: N = k·k·T_in·D_in·T_out·D_out. Initialised as the authors' Keras layer: Glorot uniform on their
    6-D kernel (k, k, T_in, D_in, T_out, D_out), for which Keras 2 takes fan_in = fan_out = √N (its fans follow
    the convolution layout only for kernels of rank 3 to 5)."""

    def __init__(
        self, in_types: int, in_dim: int, out_types: int, out_dim: int, *, kernel_size: int = 3, stride: int = 1
    ):
        super().__init__()
        self.in_types, self.in_dim, self.out_types, self.out_dim = in_types, in_dim, out_types, out_dim
        self.kernel_size, self.stride = kernel_size, stride
        self.weight = nn.Parameter(torch.empty(out_types * out_dim, in_types * in_dim, kernel_size, kernel_size))
        fan = math.sqrt(self.weight.numel())
        glorot_uniform_(self.weight, fan, fan)

    def extra_repr(self) -> str:
        return (
            f"{self.in_types}x{self.in_dim} -> {self.out_types}x{self.out_dim}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T_in, D_in, H, W] -> [B, T_out, D_out, ⌈H/s⌉, ⌈W/s⌉]."""
        b, t, d, h, w = x.shape
        if (t, d) != (self.in_types, self.in_dim):
            raise ValueError(f"ConvCaps2D expects {self.in_types} capsules of {self.in_dim}, got {t} of {d}")
        s = F.conv2d(
            same_padding(x.reshape(b, t * d, h, w), self.kernel_size, self.stride), self.weight, stride=self.stride
        )
        s = s.view(b, self.out_types, self.out_dim, *s.shape[-2:])
        return squash(s, dim=2, eps=KERAS_EPS)


class ConvCaps3D(nn.Module):
    """§3.2, Algorithm 1: 3D-convolution votes and 3D dynamic routing.

    Votes: one k×k convolution W [T_out·D_out, D_in, k, k], shared by every input capsule type i (a 3D convolution
    whose depth kernel and stride are D_in), applied to each type's D_in-channel grid:
        V_i = W ∗ u_i                                       [B, T_in, T_out, D_out, H', W']
    Routing, r iterations, logits b [B, T_in, T_out, H', W'] from 0:
        k_i = softmax_3D(b_i), over (T_out, H', W') jointly for each input type i
        S = Σ_i k_i V_i + β                                 [B, T_out, D_out, H', W'], β [T_out, D_out] from 0.1
        v = squash_3D(S), the squash of each output type's whole D_out × H' × W' block (no ε)
        b_i += Σ_d V_i · v                                  (the agreement, per position)
    `input_layout="released"` reads the input as the authors' code does (their reshape of the [B, H, W, T, D]
    tensor straight to [B, 1, T·D, H, W], which mixes positions and capsules: docs/fidelity.md, DeepCaps).

    Parameters: D_in·k·k·T_out·D_out + T_out·D_out. W starts as Keras's he_normal on their shape
    (D_in, k, k, 1, T_out·D_out) (fan_in k·k·D_in), β at 0.1."""

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        kernel_size: int = 3,
        stride: int = 1,
        iterations: int = 3,
        input_layout: Literal["capsules", "released"] = "capsules",
    ):
        super().__init__()
        if iterations < 1:
            raise ValueError(f"ConvCaps3D: iterations must be >= 1, got {iterations}")
        if input_layout not in ("capsules", "released"):
            raise ValueError(f"ConvCaps3D: input_layout must be 'capsules' or 'released', got {input_layout!r}")
        self.in_types, self.in_dim, self.out_types, self.out_dim = in_types, in_dim, out_types, out_dim
        self.kernel_size, self.stride, self.iterations = kernel_size, stride, iterations
        self.input_layout = input_layout
        self.weight = nn.Parameter(torch.empty(out_types * out_dim, in_dim, kernel_size, kernel_size))
        self.bias = nn.Parameter(torch.full((out_types, out_dim), 0.1))
        fan_in = kernel_size * kernel_size * in_dim
        # he_normal: a normal truncated at ±2σ with σ = √(2/fan_in) / 0.8796 (the std the truncation loses)
        std = math.sqrt(2.0 / fan_in) / 0.87962566103423978
        nn.init.trunc_normal_(self.weight, std=std, a=-2 * std, b=2 * std)

    def extra_repr(self) -> str:
        return (
            f"{self.in_types}x{self.in_dim} -> {self.out_types}x{self.out_dim}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, iterations={self.iterations}"
        )

    def votes(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T_in, D_in, H, W] -> V [B, T_in, T_out, D_out, H', W']."""
        b, t, d, h, w = x.shape
        if (t, d) != (self.in_types, self.in_dim):
            raise ValueError(f"ConvCaps3D expects {self.in_types} capsules of {self.in_dim}, got {t} of {d}")
        if self.input_layout == "released":  # their [B, H, W, T, D] memory reread as [B, T, D, H, W]
            x = x.permute(0, 3, 4, 1, 2).reshape(b, t, d, h, w)
        v = F.conv2d(
            same_padding(x.reshape(b * t, d, h, w), self.kernel_size, self.stride), self.weight, stride=self.stride
        )
        return v.view(b, t, self.out_types, self.out_dim, *v.shape[-2:])

    def forward(self, x: torch.Tensor, *, return_coupling: bool = False):
        """x [B, T_in, D_in, H, W] -> v [B, T_out, D_out, H', W'] (and the last k [B, T_in, T_out, H', W'])."""
        votes = self.votes(x)
        b, t_in, t_out, _, hh, ww = votes.shape
        logits = votes.new_zeros(b, t_in, t_out, hh, ww)
        bias = self.bias.to(votes.dtype)[:, :, None, None]
        for r in range(self.iterations):
            k = torch.softmax(logits.reshape(b, t_in, -1), dim=-1).view_as(logits)  # softmax_3D  [B, T_in, ...]
            s = (k.unsqueeze(3) * votes).sum(dim=1) + bias  # [B, T_out, D_out, H', W']
            sq = (s * s).sum(dim=(2, 3, 4), keepdim=True)  # squash_3D over D_out × H' × W'
            v = s * (sq / ((1.0 + sq) * torch.sqrt(sq)))
            if r < self.iterations - 1:
                logits = logits + (votes * v.unsqueeze(1)).sum(dim=3)  # b_i += V_i · v  [B, T_in, T_out, H', W']
        return (v, k) if return_coupling else v


__all__ = ["ConvCaps2D", "ConvCaps3D", "same_padding"]
