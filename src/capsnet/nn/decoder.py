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
