"""The reconstruction decoder (§4.1, Fig. 2): the selected class capsule back to an image."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class CapsuleDecoder(nn.Module):
    """Reconstruction network (Fig. 2): FC 512 → FC 1024 → FC pixels, ReLU, ReLU, sigmoid.

    Its input is all n×d capsule dimensions with every capsule but the selected one set to zero.
    """

    def __init__(
        self,
        *,
        n_capsules: int = 10,
        capsule_dim: int = 16,
        hidden: tuple[int, ...] = (512, 1024),
        out_shape: tuple[int, int, int] = (1, 28, 28),
    ):
        super().__init__()
        self.n_capsules = n_capsules
        self.out_shape = tuple(out_shape)
        sizes = [n_capsules * capsule_dim, *hidden]
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
        layers += [nn.Linear(sizes[-1], out_shape[0] * out_shape[1] * out_shape[2]), nn.Sigmoid()]
        self.net = nn.Sequential(*layers)

    def forward(self, v: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """v [B, n, d]; select: class indices [B] (or a 0/1 mask [B, n]). Returns images [B, C, H, W]."""
        if select.dim() == 1:  # one-hot by scatter: unlike F.one_hot on the CPU, no host read of the indices
            mask = v.new_zeros(select.shape[0], self.n_capsules).scatter_(1, select.long()[:, None], 1.0)
        else:
            mask = select.to(v.dtype)
        x = (v * mask.unsqueeze(-1)).flatten(1)  # keep only the selected capsule  [B, n·d]
        return self.net(x).view(-1, *self.out_shape)


class ConvCapsuleDecoder(nn.Module):
    """Efficient-CapsNet's smallNORB reconstruction network (the authors' `Generator`, EscVM/Efficient-CapsNet,
    models/efficient_capsnet_graph_smallnorb.py): the masked capsules, flattened class-major, through

        FC n·d → s0² (no activation) → reshape [1, s0, s0]
        → ×2 bilinear upsampling → 3×3 conv 64 → ×2 → 3×3 conv 128 → ×2 → 3×3 conv 128 (leaky ReLU 0.2 each)
        → 3×3 conv C, sigmoid → [C, H, W]

    All convolutions are unpadded, so H = 8·s0 − 16 (s0 = 8 for smallNORB's 48×48). The upsampling is
    half-pixel bilinear (Keras's UpSampling2D(interpolation="bilinear"), `align_corners=False` here); the leaky
    slope is `tf.nn.leaky_relu`'s 0.2.
    """

    def __init__(
        self,
        *,
        n_capsules: int = 5,
        capsule_dim: int = 16,
        out_shape: tuple[int, int, int] = (2, 48, 48),
        channels: tuple[int, int, int] = (64, 128, 128),
        negative_slope: float = 0.2,
    ):
        super().__init__()
        c, h, w = out_shape
        if h != w or (h + 16) % 8 or h < 8:
            raise ValueError(f"the convolutional decoder needs square images with side 8·k − 16 >= 8, got {h}×{w}")
        self.n_capsules, self.out_shape, self.seed_side = n_capsules, tuple(out_shape), (h + 16) // 8
        self.negative_slope = negative_slope
        self.fc = nn.Linear(n_capsules * capsule_dim, self.seed_side**2)
        sizes = (1, *channels)
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3) for a, b in itertools.pairwise(sizes))
        self.out = nn.Conv2d(channels[-1], c, 3)

    def forward(self, v: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """v [B, n, d]; select: class indices [B] (or a 0/1 mask [B, n]). Returns images [B, C, H, W]."""
        if select.dim() == 1:
            mask = v.new_zeros(select.shape[0], self.n_capsules).scatter_(1, select.long()[:, None], 1.0)
        else:
            mask = select.to(v.dtype)
        x = self.fc((v * mask.unsqueeze(-1)).flatten(1))  # [B, s0²]
        x = x.view(-1, 1, self.seed_side, self.seed_side)  # [B, 1, s0, s0]
        for conv in self.convs:  # s → 2s → 2s − 2
            x = nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            x = nn.functional.leaky_relu(conv(x), self.negative_slope)
        return torch.sigmoid(self.out(x))  # [B, C, H, W]
