"""Matrix capsule layers routed by variational Bayes (Ribeiro, Leontidis & Kollias, AAAI 2020), as the authors'
released layers (fabio-deep/Variational-Capsule-Routing: layers.py, vb_routing.py): primary capsules with
BatchNorm, convolutional capsules, and class capsules with coordinate addition.

A capsule layer is a grid of capsule types, as EM routing's (capsnet.routing.matrix_capsules, whose field gathering,
votes V_ij = M_i W_ij and coordinate addition these reuse): poses M [B, H, W, T, 16] (4×4 matrices, row-major) and
activations a [B, H, W, T] in (0, 1). Each routed layer normalises its output as the authors' does
(`capsnet.routing.vb.VBNorm`: BatchNorm without affine parameters of the poses and of the activation logits).
Their W_ij start Xavier-uniform with fans types · K² · 16.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import autocast_off
from .matrix_capsules import CapsuleFields, class_votes, field_votes, gather_fields
from .vb import DEFAULT_PRIOR, MIN_NORMALISER, VBNorm, VBPrior, VBResult, routing_dtype, vb_routing, xavier_bound


class VBPrimaryCaps(nn.Module):
    """The authors' PrimaryCapsules2d: a K×K convolution without bias from A channels to B types of 4×4 poses
    (BatchNorm over each type's 16 entries and positions, affine) and activations sigmoid(BatchNorm(conv)).

    Parameters: A·B·16·K² + A·B·K² (Xavier-uniform) + 2·B + 2·B (the two BatchNorms' scale and shift)."""

    def __init__(self, in_channels: int, n_types: int, *, kernel_size: int = 1, stride: int = 1):
        super().__init__()
        self.n_types = n_types
        self.pose = nn.Conv2d(in_channels, n_types * 16, kernel_size, stride=stride, bias=False)
        self.activation = nn.Conv2d(in_channels, n_types, kernel_size, stride=stride, bias=False)
        self.pose_norm = nn.BatchNorm3d(n_types)
        self.activation_norm = nn.BatchNorm2d(n_types)
        nn.init.xavier_uniform_(self.pose.weight)
        nn.init.xavier_uniform_(self.activation.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, A, H, W] -> poses [B, H', W', T, 16], activations [B, H', W', T]."""
        pose = self.pose(x)
        b, _, hh, ww = pose.shape
        pose = self.pose_norm(pose.view(b, self.n_types, 16, hh, ww))  # [B, T, 16, H', W']
        acts = torch.sigmoid(self.activation_norm(self.activation(x)))  # [B, T, H', W']
        return pose.permute(0, 3, 4, 1, 2), acts.permute(0, 2, 3, 1)


class VBConvCaps(CapsuleFields, nn.Module):
    """A convolutional capsule layer routed by VB (the authors' ConvCapsules2d + VariationalBayesRouting2d): each
    parent at each output position is a component fitted to the votes of the K×K×T_in children in its field; W_ij
    depends on the kernel offset, the child type and the parent type and is shared across positions; R_ij is
    normalised over every parent a child reaches, at all positions.

    Parameters: K·K·T_in·T_out·16 (W) + 2·T_out (β_u, β_a)."""

    def __init__(
        self,
        in_types: int,
        out_types: int,
        *,
        kernel_size: int = 3,
        stride: int = 1,
        iterations: int = 3,
        prior: VBPrior = DEFAULT_PRIOR,
        min_normaliser: float = MIN_NORMALISER,
        batchnorm: bool = True,
    ):
        super().__init__()
        self.in_types, self.out_types = in_types, out_types
        self.kernel_size, self.stride = kernel_size, stride
        self.iterations, self.prior, self.min_normaliser = iterations, prior, min_normaliser
        k2 = kernel_size * kernel_size
        bound = xavier_bound(in_types * k2 * 16, out_types * k2 * 16)
        self.weight = nn.Parameter(torch.empty(out_types, k2 * in_types, 4, 4).uniform_(-bound, bound))  # [J, I, 4, 4]
        self.beta_u = nn.Parameter(torch.zeros(out_types))
        self.beta_a = nn.Parameter(torch.zeros(out_types))
        self.norm = VBNorm(out_types, enabled=batchnorm)
        self._index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def route(self, poses: torch.Tensor, activations: torch.Tensor) -> tuple[VBResult, tuple[int, int]]:
        """The VB result [B, P, J, ...] (before VBNorm) and the output grid."""
        _, hh, ww, t, _ = poses.shape
        out_h, out_w, pos, child = self.fields(poses)
        with autocast_off(poses.device.type):  # in float32 (or 64): routing_dtype
            dtype = routing_dtype(poses)
            m, a = gather_fields(
                poses.to(dtype), activations.to(dtype), pos, out_h * out_w
            )  # [B, P, I, 4, 4], [B, P, I]
            res = vb_routing(
                field_votes(m, self.weight.to(dtype)),
                a,
                self.beta_u.to(dtype),
                self.beta_a.to(dtype),
                iterations=self.iterations,
                prior=self.prior,
                child_index=child,
                n_children=hh * ww * t,
                min_normaliser=self.min_normaliser,
            )
        return res, (out_h, out_w)

    def forward(self, poses: torch.Tensor, activations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """poses [B, H, W, T_in, 16], activations [B, H, W, T_in] -> [B, H', W', T_out, 16], [B, H', W', T_out]."""
        res, (out_h, out_w) = self.route(poses, activations)
        m, a = self.norm(res)  # [B, P, J, 16], [B, P, J]
        b = poses.shape[0]
        return m.reshape(b, out_h, out_w, self.out_types, 16), a.reshape(b, out_h, out_w, self.out_types)


class VBClassCaps(nn.Module):
    """Class capsules routed by VB (the authors' ClassCaps, `share_W_ij=True, coor_add=True`, and ClassRouting):
    every child on the H×W grid votes for each class with one W per (child type, class), shared across positions,
    plus its coordinates (`centres` [H·W, 2] into V_ij[0, 3] and V_ij[1, 3]; None: no coordinate addition).

    Parameters: T_in·n·16 (W) + 2·n (β_u, β_a)."""

    centres: torch.Tensor | None  # a buffer, not saved

    def __init__(
        self,
        in_types: int,
        n_classes: int,
        *,
        iterations: int = 3,
        centres: torch.Tensor | None = None,
        prior: VBPrior = DEFAULT_PRIOR,
        min_normaliser: float = MIN_NORMALISER,
        batchnorm: bool = True,
    ):
        super().__init__()
        self.in_types, self.n_classes = in_types, n_classes
        self.iterations, self.prior, self.min_normaliser = iterations, prior, min_normaliser
        bound = xavier_bound(in_types * 16, n_classes * 16)
        self.weight = nn.Parameter(torch.empty(n_classes, in_types, 4, 4).uniform_(-bound, bound))  # W_j,t [J, T, 4, 4]
        self.beta_u = nn.Parameter(torch.zeros(n_classes))
        self.beta_a = nn.Parameter(torch.zeros(n_classes))
        self.norm = VBNorm(n_classes, enabled=batchnorm)
        self.register_buffer("centres", centres, persistent=False)

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, n_classes={self.n_classes}, iterations={self.iterations}, "
            f"coordinate_addition={self.centres is not None}"
        )

    def forward(self, poses: torch.Tensor, activations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, VBResult]:
        """poses [B, H, W, T, 16], activations [B, H, W, T] -> class poses [B, n, 16], activations [B, n], and the
        VB result with P = 1 (assignments R [B, 1, n, H·W·T], children position-major, type-minor)."""
        b, hh, ww, t, _ = poses.shape
        if t != self.in_types:
            raise ValueError(f"VBClassCaps expects {self.in_types} capsule types, got {t}")
        with autocast_off(poses.device.type):  # in float32 (or 64): routing_dtype
            dtype = routing_dtype(poses)
            votes = class_votes(poses.to(dtype), self.weight.to(dtype), self.centres)  # [B, 1, J, H·W·T, 16]
            res = vb_routing(
                votes,
                activations.to(dtype).reshape(b, 1, hh * ww * t),
                self.beta_u.to(dtype),
                self.beta_a.to(dtype),
                iterations=self.iterations,
                prior=self.prior,
                min_normaliser=self.min_normaliser,
            )
        m, a = self.norm(res)
        return m[:, 0], a[:, 0], res


__all__ = ["VBClassCaps", "VBConvCaps", "VBPrimaryCaps"]
