"""Primary capsules (§4): a convolution whose output channels form squashed capsule vectors."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.base import conv_output_size as conv_output_size
from .squash import squash


class PrimaryCapsules(nn.Module):
    """A convolution whose output channels form capsules (the paper's PrimaryCaps layer).

    `n_types` capsule types of `capsule_dim` dimensions: each capsule's vector is `capsule_dim` channels of one
    type at one spatial location. For MNIST: 256 → 32 types × 8D, kernel 9, stride 2, giving 32·6·6 = 1152
    capsules. Output [B, n_types·H'·W', capsule_dim], ordered type-major (type, row, column), squashed.

    Two options reproduce released implementations (docs/fidelity.md):

    - `vote_scale`: the convolution's output (not its bias) times this factor before the squash. The official
      TensorFlow code (Sabour et al.) passes the primary capsules through a one-iteration routing over the
      `n_types` types, whose uniform coupling 1/n_types (1/(n_types + 1) with leaky routing) scales the votes.
    - `grouping="flat"`: each capsule is `capsule_dim` consecutive values of the flattened [types·D, H', W'] map
      (XifengGuo/CapsNet-Pytorch's `view(B, -1, D)`), so capsules run along rows, not across channels.
    """

    def __init__(
        self,
        *,
        in_channels: int = 256,
        n_types: int = 32,
        capsule_dim: int = 8,
        kernel_size: int = 9,
        stride: int = 2,
        padding: int = 0,
        vote_scale: float = 1.0,
        grouping: Literal["types", "flat"] = "types",
    ):
        super().__init__()
        if grouping not in ("types", "flat"):
            raise ValueError(f"PrimaryCapsules: grouping must be 'types' or 'flat', got {grouping!r}")
        self.n_types = n_types
        self.capsule_dim = capsule_dim
        self.vote_scale, self.grouping = vote_scale, grouping
        self.conv = nn.Conv2d(in_channels, n_types * capsule_dim, kernel_size, stride=stride, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vote_scale == 1.0:
            y = self.conv(x)  # [B, types·D, H', W'], channel = type·D + d
        else:  # the one-iteration routing: (W * x) · scale + bias
            y = F.conv2d(x, self.conv.weight, None, self.conv.stride, self.conv.padding) * self.vote_scale
            assert self.conv.bias is not None
            y = y + self.conv.bias.view(1, -1, 1, 1)
        b, _, h, w = y.shape
        if self.grouping == "flat":  # D consecutive values of the flattened map  [B, types·H'·W', D]
            return squash(y.reshape(b, -1, self.capsule_dim))
        # [B, types, D, H', W'] -> [B, types, H', W', D] -> [B, types·H'·W', D]
        u = y.view(b, self.n_types, self.capsule_dim, h, w).permute(0, 1, 3, 4, 2)
        return squash(u.reshape(b, self.n_types * h * w, self.capsule_dim))

    def output_grid(self, height: int, width: int) -> tuple[int, int]:
        """Spatial size (H', W') of the capsule grid for an input feature map of `height` × `width`."""
        k, s, p = self.conv.kernel_size, self.conv.stride, self.conv.padding
        assert not isinstance(p, str)  # the convolution is built with numeric padding, never "same"/"valid"
        return conv_output_size(height, k[0], s[0], p[0]), conv_output_size(width, k[1], s[1], p[1])
