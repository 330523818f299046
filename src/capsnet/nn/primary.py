"""Primary capsules (§4): a convolution whose output channels form squashed capsule vectors."""

from __future__ import annotations

import torch
from torch import nn

from .squash import squash


class PrimaryCapsules(nn.Module):
    """A convolution whose output channels form capsules (the paper's PrimaryCaps layer).

    `n_types` capsule types of `capsule_dim` dimensions: each capsule's vector is `capsule_dim` channels of one
    type at one spatial location. For MNIST: 256 → 32 types × 8D, kernel 9, stride 2, giving 32·6·6 = 1152
    capsules. Output [B, n_types·H'·W', capsule_dim], ordered type-major (type, row, column), squashed.
    """

    def __init__(
        self,
        *,
        in_channels: int = 256,
        n_types: int = 32,
        capsule_dim: int = 8,
        kernel_size: int = 9,
        stride: int = 2,
    ):
        super().__init__()
        self.n_types = n_types
        self.capsule_dim = capsule_dim
        self.conv = nn.Conv2d(in_channels, n_types * capsule_dim, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)  # [B, types·D, H', W'], channel = type·D + d
        b, _, h, w = y.shape
        # [B, types, D, H', W'] -> [B, types, H', W', D] -> [B, types·H'·W', D]
        u = y.view(b, self.n_types, self.capsule_dim, h, w).permute(0, 1, 3, 4, 2)
        return squash(u.reshape(b, self.n_types * h * w, self.capsule_dim))

    def output_grid(self, height: int, width: int) -> tuple[int, int]:
        """Spatial size (H', W') of the capsule grid for an input feature map of `height` × `width`."""
        k, s = self.conv.kernel_size, self.conv.stride
        return (height - k[0]) // s[0] + 1, (width - k[1]) // s[1] + 1
