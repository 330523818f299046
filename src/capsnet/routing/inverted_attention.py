"""Inverted dot-product attention routing (Tsai, Srivastava, Goh & Salakhutdinov, ICLR 2020).

"Capsules with Inverted Dot-Product Attention Routing", Procedure 1 and §2. Symbols, for child capsules i in
layer L and parent capsules j in layer L+1:

  p_i^L     child pose                                              [B, n_in, d]
  W_ij      transformation; a √d×√d matrix for matrix poses         [n_in, n_out, √d, √d] (or [.., d_in, d_out])
  v_ij      Eq. 1: vote W_ij · p_i                                  [B, n_in, n_out, d]
  a_ij      Eq. 2: agreement p_jᵀ v_ij, the parent pose p_j from the previous iteration (0 at first)
  r_ij      Eq. 3: routing coefficient, softmax over the parents j  [B, n_in, n_out]
  p_j       Eq. 4: LayerNorm(Σ_i r_ij v_ij)                          [B, n_out, d]

The parents compete for each child (softmax over j), hence "inverted" attention. With p_j = 0 the first pass
routes uniformly. In a network of several capsule layers the iterations run concurrently (§2.2, Procedure 2):
one uniform pass up the stack, then every iteration updates every layer from the previous iteration's poses of
the layers below and above it; `concurrent_routing` does that. A layer called on its own routes
sequentially: `iterations` passes, each from its own previous output.

On CPUs the layers run every pass of a call, votes included, as one fused kernel with an analytic backward
(`capsnet.routing.inverted_attention_cpu`); elsewhere, with `layer.fast = False`, or where the kernel cannot be
built, they use `inverted_attention_step` below, the reference the kernel is tested against.

`InvertedAttentionFC` connects every child to every parent; `InvertedAttentionConv` connects the
children in a k×k window (all input types) to the parents at that location, with weights shared over locations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import inverted_attention_cpu as ia_cpu
from .backend import KernelLayer
from .base import RoutingOutput, check_capsules, check_sizes, matrix_votes, matrix_weight_shape, votes


def inverted_attention_step(
    v: torch.Tensor, parent: torch.Tensor | None, norm: nn.LayerNorm, *, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of Procedure 1 on votes v [N, n_in, n_out, d] given the parents' poses [N, n_out, d] (None: 0).

    Returns the new parent poses [N, n_out, d] and the routing coefficients r [N, n_in, n_out].
    """
    if parent is None:  # p_j = 0: every agreement is 0 and r_ij = 1 / n_out
        r = v.new_full(v.shape[:3], 1.0 / v.shape[2])
    else:
        a = torch.einsum("nijd,njd->nij", v, parent) * scale  # Eq. 2: a_ij = p_jᵀ v_ij  [N, n_in, n_out]
        r = torch.softmax(a, dim=2)  # Eq. 3: softmax over the parents j
    p = torch.einsum("nij,nijd->njd", r, v)  # Σ_i r_ij v_ij  [N, n_out, d]
    return norm(p), r  # Eq. 4: LayerNorm


class _InvertedAttention(KernelLayer, nn.Module):
    """Shared parts: the weights, the LayerNorm of Eq. 4, the number of sequential iterations, and the choice of
    the fused CPU kernel (`fast`, default True; False: the PyTorch reference, which also allows double backward;
    `backend`: see `capsnet.routing.backend`)."""

    matrix_pose: bool
    scale: float
    fast: bool = True

    def _init_weights(self, n_in: int, n_out: int, d_in: int, d_out: int, matrix_pose: bool, fan_in: int) -> None:
        shape = matrix_weight_shape(type(self).__name__, n_in, n_out, d_in, d_out, matrix_pose)
        self.weight = nn.Parameter(torch.empty(shape))
        self.matrix_pose = matrix_pose
        self.norm = nn.LayerNorm(d_out)
        # Keep Σ_i r_ij v_ij of order 1 at the uniform first pass (r = 1/n_out over fan_in children).
        nn.init.normal_(self.weight, std=math.sqrt(n_out / (fan_in * self.weight.shape[-2])))

    def votes(self, u: torch.Tensor) -> torch.Tensor:
        """Eq. 1: v_ij = W_ij · p_i for u [N, n_in, d_in] -> [N, n_in, n_out, d_out]."""
        return matrix_votes(self.weight, u) if self.matrix_pose else votes(self.weight, u)

    def passes(self, u: torch.Tensor, parent: torch.Tensor | None, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`steps` passes of Procedure 1 on children u [N, n_in, d_in] from the parents' poses [N, n_out, d_out]
        (None: p_j = 0). Returns the last poses [N, n_out, d_out] and routing coefficients r [N, n_in, n_out]."""
        if self.fast and ia_cpu.applicable(u, self.weight, self.backend):
            return ia_cpu.cpu_inverted_attention(
                u, self.weight, self.norm, parent, steps, scale=self.scale, matrix_pose=self.matrix_pose
            )
        v = self.votes(u)  # computed once, reused by every pass
        for _ in range(steps):
            parent, r = inverted_attention_step(v, parent, self.norm, scale=self.scale)
        assert parent is not None  # at least one step ran
        return parent, r


class InvertedAttentionFC(_InvertedAttention):
    """Fully connected capsule layer with inverted dot-product attention routing.

    Args:
        in_caps, out_caps, in_d, out_d: numbers and dimensions of child and parent capsules.
        iterations: routing iterations when the layer routes on its own (the first is the uniform pass).
        matrix_pose: poses are √d×√d matrices and W_ij is √d×√d (the paper's CIFAR models; d_in = d_out).
        agreement_scale: factor on the agreement of Eq. 2 (1, the paper's equation; the authors' code uses 1/√d).
    """

    def __init__(
        self,
        in_caps: int,
        out_caps: int,
        in_d: int,
        out_d: int,
        iterations: int = 2,
        *,
        matrix_pose: bool = False,
        agreement_scale: float = 1.0,
    ):
        super().__init__()
        check_sizes("InvertedAttentionFC", in_caps, out_caps, in_d, out_d, iterations)
        self.in_caps, self.out_caps, self.in_d, self.out_d = in_caps, out_caps, in_d, out_d
        self.iterations, self.scale = iterations, agreement_scale
        self._init_weights(in_caps, out_caps, in_d, out_d, matrix_pose, fan_in=in_caps)

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, out_caps={self.out_caps}, in_d={self.in_d}, out_d={self.out_d}, "
            f"iterations={self.iterations}, matrix_pose={self.matrix_pose}"
        )

    def route(self, u: torch.Tensor, parent: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of Procedure 1 from the parents' current poses (None: the uniform first pass). A capsule grid
        [B, T, H, W, d] (a convolutional layer's output) is read as T·H·W capsules."""
        return self.passes(u.flatten(1, 3) if u.dim() == 5 else u, parent, 1)

    def forward(
        self,
        u: torch.Tensor,
        a: torch.Tensor | None = None,
        *,
        parent: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | RoutingOutput:
        """u [B, in_caps, in_d] -> parent poses [B, out_caps, out_d]. With `parent` given: one pass from it (a step
        of concurrent routing); without: `iterations` sequential passes from p_j = 0."""
        check_capsules("InvertedAttentionFC", u, self.in_caps, self.in_d)
        if a is not None:
            raise ValueError("InvertedAttentionFC takes no input activations (pass a=None)")
        p, r = self.passes(u, parent, 1 if parent is not None else self.iterations)
        return RoutingOutput(p, r) if return_weights else p


class InvertedAttentionConv(_InvertedAttention):
    """Convolutional capsule layer: children in a k×k window of every input type route to the parents there.

    Input and output poses are capsule grids [B, types, H, W, d]. Each (child, window) pair routes on its own,
    as in the paper's convolutional capsule layers; W is shared over locations: [k·k·in_types, out_types, ...].

    `windows="released"` reproduces the authors' released `CapsuleCONV.input_expansion`
    (apple/ml-capsules-inverted-attention-routing, src/layers.py), which stacks the k×k windows on the last axis
    ([.., d, L] for L output locations) and reads that memory as [.., L, d], so a child's "pose" at one location
    mixes components of several locations. For weights trained that way (their checkpoints, converted); capsnet's
    converted poses are the transposes of theirs, so the mixing is applied in their (row-major) component order.
    """

    def __init__(
        self,
        in_types: int,
        out_types: int,
        d: int,
        kernel_size: int = 3,
        stride: int = 1,
        iterations: int = 2,
        *,
        matrix_pose: bool = True,
        agreement_scale: float = 1.0,
        windows: str = "true",
    ):
        super().__init__()
        check_sizes("InvertedAttentionConv", in_types, out_types, d, kernel_size, stride, iterations)
        if windows not in ("true", "released"):
            raise ValueError(f"InvertedAttentionConv: windows must be 'true' or 'released', got {windows!r}")
        self.windows = windows
        self.in_types, self.out_types, self.d, self.k, self.stride = in_types, out_types, d, kernel_size, stride
        self.iterations, self.scale = iterations, agreement_scale
        n_in = in_types * kernel_size * kernel_size
        self._init_weights(n_in, out_types, d, d, matrix_pose, fan_in=n_in)

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, out_types={self.out_types}, d={self.d}, kernel_size={self.k}, "
            f"stride={self.stride}, iterations={self.iterations}, matrix_pose={self.matrix_pose}"
            + (f", windows={self.windows!r}" if self.windows != "true" else "")
        )

    def output_grid(self, size: int) -> int:
        return (size - self.k) // self.stride + 1

    def _windows(self, u: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """[B, T, H, W, d] -> children per output location [B·H'·W', k·k·T, d] (ordered type, ky, kx)."""
        if u.dim() != 5 or u.shape[1] != self.in_types or u.shape[4] != self.d:
            raise ValueError(
                f"InvertedAttentionConv expects poses [B, {self.in_types}, H, W, {self.d}], got {list(u.shape)}"
            )
        b, t, h, w, d = u.shape
        cols = F.unfold(u.permute(0, 1, 4, 2, 3).reshape(b, t * d, h, w), self.k, stride=self.stride)
        ho, wo = self.output_grid(h), self.output_grid(w)
        cols = cols.view(b, t, d, self.k * self.k, ho * wo).permute(0, 4, 1, 3, 2)  # [B, L, T, k·k, d]
        if self.windows == "released":
            cols = released_windows(cols, self.matrix_pose)
        return cols.reshape(b * ho * wo, t * self.k * self.k, d), ho, wo

    def _grid(self, p: torch.Tensor, b: int, ho: int, wo: int) -> torch.Tensor:
        return p.view(b, ho, wo, self.out_types, self.d).permute(0, 3, 1, 2, 4)  # [B, T', H', W', d]

    def route(self, u: torch.Tensor, parent: torch.Tensor | None, steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`steps` passes from the parents' poses [B, T', H', W', d] (None: p_j = 0) -> the new poses and the
        routing coefficients [B, H'·W', k·k·T, T']."""
        children, ho, wo = self._windows(u)
        if parent is not None:  # [B, T', H', W', d] -> [B·H'·W', T', d]
            parent = parent.permute(0, 2, 3, 1, 4).reshape(-1, self.out_types, self.d)
        p, r = self.passes(children, parent, steps)
        return self._grid(p, u.shape[0], ho, wo), r.view(u.shape[0], ho * wo, *r.shape[1:])

    def forward(self, u: torch.Tensor, *, parent: torch.Tensor | None = None) -> torch.Tensor:
        """u [B, in_types, H, W, d] -> [B, out_types, H', W', d]; `parent` as in `InvertedAttentionFC`."""
        return self.route(u, parent, 1 if parent is not None else self.iterations)[0]


def released_windows(cols: torch.Tensor, matrix_pose: bool) -> torch.Tensor:
    """The authors' released window expansion (see `InvertedAttentionConv`) from the true windows
    cols [B, L, T, k·k, d]: per (type, offset), the [L, d] block of poses is reread from its [d, L] transpose's
    memory. With matrix poses the components are first put in the authors' order (the transpose) and back after."""
    b, n_loc, t, kk, d = cols.shape
    x = cols.permute(0, 2, 3, 1, 4)  # [B, T, k·k, L, d]
    side = math.isqrt(d)
    perm = torch.arange(d, device=cols.device).view(side, side).t().reshape(-1) if matrix_pose else None
    if perm is not None:
        x = x[..., perm]  # capsnet's P = their Pᵀ: their component order
    x = x.transpose(-1, -2).reshape(b, t, kk, n_loc, d)  # the stack on the last axis, read as [L, d]
    if perm is not None:
        x = x[..., perm]
    return x.permute(0, 3, 1, 2, 4)  # [B, L, T, k·k, d]


def concurrent_routing(
    layers: Sequence[InvertedAttentionFC | InvertedAttentionConv], u: torch.Tensor, iterations: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Concurrent iterative routing through stacked layers (§2.2): poses of every layer after `iterations` passes.

    Pass 1 goes up the stack with uniform routing; pass t > 1 updates every layer l from the poses of pass t − 1
    of layers l and l+1 (parallel in time). Returns [p^1, ..., p^L] and the last layer's routing weights.
    """
    poses, x = [], u
    for layer in layers:  # first iteration: a single feed-forward pass, r uniform
        x, r = layer.route(x, None)
        poses.append(x)
    for _ in range(iterations - 1):
        below = [u, *poses[:-1]]
        new = [layer.route(x_in, p_old) for layer, x_in, p_old in zip(layers, below, poses, strict=True)]
        poses, r = [p for p, _ in new], new[-1][1]
    return poses, r
