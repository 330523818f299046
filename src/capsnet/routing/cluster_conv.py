"""Convolutional capsule layer with non-iterative cluster routing (Zhao & Cheng, Neural Networks 2021), the layer of
the authors' models (capsnet.models.cluster_capsnet), batch-first.

A layer holds C capsule channels, each a grid of D-dimensional capsules: x [B, C_in, D_in, H, W]. Each input
channel i votes for each output channel j at every location with K convolutions of its own (k×k, shared over
locations), and the votes are routed per location and dimension as in capsnet.routing.cluster:

  V^k_ij   conv^k_ij(x_i), 3×3, padding 1, biased                          [B, I, K, J, D, H', W']
  μ_ij, σ_ij   mean and population std over the K votes                    [B, I, J, D, H', W']
  s_j      Σ_i softmax_i(−log σ_ij) μ_ij                                   [B, J, D, H', W']
  v_j      LayerNorm over (D, H', W') of each channel, γ and β [D, H', W'] shared by the channels

The authors (github.com/ZHAOZHIHAO/ClusterRouting, src/capsule_network.py, `CapsLayerWithClusterRouting`) run one
convolution per input channel, D_in -> K·C_out·D outputs read as [K, C_out, D], keep the channels as a list and
route each output channel in a loop. Here the C_in convolutions are one grouped convolution (groups = C_in) whose
output is read as [C_in, K, C_out, D], and the routing is one pass over every channel. The first layer reads the
image, not capsules: each of its C_in "input channels" convolves the same image (`image_input=True`: one
convolution with C_in·K·C_out·D outputs).

Parameters: `conv`, weight [C_in·K·C_out·D, D_in, k, k] (input channel i's block is the authors'
conv_trans[i].weight) and bias [C_in·K·C_out·D], drawn as PyTorch draws a convolution's; LayerNorm γ = 1, β = 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import check_sizes
from .cluster import VOTES, cluster_route


class ClusterRoutingConv(nn.Module):
    """x [B, in_channels, in_d, H, W] (or an image [B, in_d, H, W] with `image_input`) -> v [B, out_channels,
    out_d, H', W'].

    Args:
        in_channels, out_channels: capsule channels C_in and C_out.
        in_d, out_d: capsule dimensions (with `image_input`, in_d is the image's channels).
        out_hw: (H', W'), the output grid, which the LayerNorm's γ and β cover.
        votes: K votes per cluster. kernel_size, stride, padding: of the vote convolutions (the authors': 3, -, 1).
        bias: biased vote convolutions (the authors' default). image_input: the first layer (see the module).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        in_d: int,
        out_d: int,
        out_hw: tuple[int, int],
        *,
        votes: int = VOTES,
        kernel_size: int = 3,
        stride: int = 1,
        padding: int = 1,
        bias: bool = True,
        image_input: bool = False,
    ):
        super().__init__()
        check_sizes("ClusterRoutingConv", in_channels, out_channels, in_d, out_d, votes, kernel_size, stride)
        if votes < 2:
            raise ValueError(f"ClusterRoutingConv: a cluster needs at least 2 votes to have a spread, got {votes}")
        self.in_channels, self.out_channels, self.in_d, self.out_d = in_channels, out_channels, in_d, out_d
        self.votes, self.stride, self.padding, self.image_input = votes, stride, padding, image_input
        n_votes = in_channels * votes * out_channels * out_d
        # the C_in vote convolutions as one: PyTorch's default draw is the authors' (U(±1/√(D_in·k·k)))
        self.conv = nn.Conv2d(
            in_d if image_input else in_channels * in_d,
            n_votes,
            kernel_size,
            stride=stride,
            padding=padding,
            bias=bias,
            groups=1 if image_input else in_channels,
        )
        self.norm = nn.LayerNorm([out_d, *out_hw])

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, out_channels={self.out_channels}, in_d={self.in_d}, "
            f"out_d={self.out_d}, votes={self.votes}, stride={self.stride}, "
            f"image_input={self.image_input}"
        )

    def cluster_votes(self, x: torch.Tensor) -> torch.Tensor:
        """V^k_ij for every location: [B, C_in, K, C_out, D, H', W']."""
        v = self.conv(x if self.image_input else x.flatten(1, 2))  # [B, C_in·K·C_out·D, H', W']
        return v.view(v.shape[0], self.in_channels, self.votes, self.out_channels, self.out_d, *v.shape[-2:])

    def forward(
        self, x: torch.Tensor, *, return_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [B, C_in, D_in, H, W] (image [B, D_in, H, W] with image_input) -> v [B, C_out, D, H', W'], and with
        return_weights the c_ij [B, C_in, C_out, D, H', W'] (summing to 1 over the input channels)."""
        expected = (self.in_d,) if self.image_input else (self.in_channels, self.in_d)
        if x.dim() != len(expected) + 3 or tuple(x.shape[1 : 1 + len(expected)]) != expected:
            shape = ", ".join(map(str, expected))
            raise ValueError(f"ClusterRoutingConv expects input of shape [B, {shape}, H, W], got {list(x.shape)}")
        s, c = cluster_route(self.cluster_votes(x), child_dim=1, vote_dim=2)  # s_j [B, C_out, D, H', W']
        v = F.layer_norm(s, s.shape[2:], self.norm.weight, self.norm.bias, self.norm.eps)  # LayerNorm(s_j)
        return (v, c) if return_weights else v


__all__ = ["ClusterRoutingConv"]
