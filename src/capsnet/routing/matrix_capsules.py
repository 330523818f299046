"""Matrix capsule layers (Hinton, Sabour & Frosst, ICLR 2018, §3): primary capsules, convolutional capsules routed
by EM, and class capsules with coordinate addition.

A capsule layer is a grid of capsule types: poses M [B, H, W, T, 16] (4×4 matrices, row-major) and activations
a [B, H, W, T] in (0, 1).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..configs.base import FINAL_LAMBDA
from .em import MIN_VAR, EMResult, em_routing, inverse_temperature
from .em_conv import conv_em_routing


class _CentredActivations(nn.Module):
    """Optional data-dependent start for β_a (as ActNorm's, Kingma & Dhariwal 2018): on the first training batch,
    β_a_j is shifted so that the mean logit λ(β_a − Σ_h cost_h) of each parent type is 0, i.e. about half the
    capsules are active at the start — what the authors say they aimed for with their initialisation (OpenReview;
    quoted in Gritzman 2019's code). Without it the class activations start saturated near 1 (the cost is
    ~10³ × λ ~ 10⁻³). A persistent flag records that it was done, so a loaded model is not re-initialised.

    The flag is a buffer (saved with the weights) mirrored by a host bool, `centred`, so that the check in every
    training forward never reads the device; loading a state dict sets both. Under DistributedDataParallel the
    centring must happen before the model is wrapped, on a batch every rank agrees on
    (`capsnet.models.em_capsnet.EMCapsNet.init_from_data`; `capsnet train` does so): DDP never broadcasts
    the parameters again."""

    iterations: int  # (set by the subclasses)
    final_lambda: float
    beta_a: nn.Parameter
    beta_a_ready: torch.Tensor  # a buffer

    def _setup_centring(self, enabled: bool) -> None:
        self.centre_activations = enabled
        self.register_buffer("beta_a_ready", torch.tensor(not enabled))
        self.centred = not enabled  # the host's copy of beta_a_ready

    @torch.no_grad()
    def _centre(self, route) -> None:
        if self.training and not self.centred:
            logits = route().logits  # [B, P, J]
            lam = inverse_temperature(self.iterations - 1, self.final_lambda)
            self.beta_a.sub_(logits.mean(dim=(0, 1)) / lam)
            self.beta_a_ready.fill_(True)
            self.centred = True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        ready = state_dict.get(prefix + "beta_a_ready")
        if ready is not None:  # (read once, at load time)
            self.centred = bool(ready)


class PrimaryMatrixCaps(nn.Module):
    """§3: a 1×1 convolution from A channels to B capsule types: 4×4 poses, and sigmoid activations.

    Parameters: A·B·16 + B·16 (pose) + A·B + B (activation)."""

    def __init__(self, in_channels: int, n_types: int):
        super().__init__()
        self.n_types = n_types
        self.pose = nn.Conv2d(in_channels, n_types * 16, kernel_size=1)
        self.activation = nn.Conv2d(in_channels, n_types, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, A, H, W] -> poses [B, H, W, T, 16], activations [B, H, W, T]."""
        b, _, hh, ww = x.shape
        poses = self.pose(x).permute(0, 2, 3, 1).reshape(b, hh, ww, self.n_types, 16)
        acts = torch.sigmoid(self.activation(x)).permute(0, 2, 3, 1)
        return poses, acts


def field_indices(
    height: int, width: int, kernel_size: int, stride: int, in_types: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(child positions of every parent's K×K field [P·K·K], child index of each slot [P, K·K·T_in]) on an H×W grid;
    slots are position-major, type-minor: I = (kernel offset, child type)."""
    pos = _field_positions(height, width, kernel_size, stride)  # [P, K·K]
    child = (pos.unsqueeze(-1) * in_types + torch.arange(in_types)).reshape(pos.shape[0], -1)
    return pos.reshape(-1), child


def gather_fields(
    poses: torch.Tensor, activations: torch.Tensor, positions: torch.Tensor, n_parents: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The children in each field, gathered: poses [B, H, W, T, 16], activations [B, H, W, T] -> M_i [B, P, I, 4, 4],
    a_i [B, P, I] (`positions` from `field_indices`)."""
    b, hh, ww, t, _ = poses.shape
    m = poses.reshape(b, hh * ww, t, 16).index_select(1, positions).reshape(b, n_parents, -1, 4, 4)
    a = activations.reshape(b, hh * ww, t).index_select(1, positions).reshape(b, n_parents, -1)
    return m, a


def field_votes(m: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """V_ij = M_i W_ij for the children in each field: M [B, P, I, 4, 4], W [J, I, 4, 4] -> [B, P, J, I, 16]."""
    b, p = m.shape[:2]
    return torch.einsum("bpiac,jicd->bpjiad", m, weight).reshape(b, p, weight.shape[0], -1, 16)


def class_votes(poses: torch.Tensor, weight: torch.Tensor, centres: torch.Tensor | None) -> torch.Tensor:
    """Class capsules' votes V_ij = M_i W_j,type(i), one W per (child type, class) shared across positions, plus the
    coordinates (coordinate addition): `centres[:, 0]` into V_ij[0, 3], `centres[:, 1]` into V_ij[1, 3] at each
    position (None: none). poses [B, H, W, T, 16], W [J, T, 4, 4] -> [B, 1, J, H·W·T, 16] (children
    position-major, type-minor)."""
    b, hh, ww, t, _ = poses.shape
    m = poses.reshape(b, hh * ww, t, 4, 4)
    votes = torch.einsum("bstac,jtcd->bjstad", m, weight)  # V_ij  [B, J, H·W, T, 4, 4]
    if centres is not None:
        if centres.shape[0] != hh * ww:
            raise ValueError(f"class capsules built for {centres.shape[0]} positions got a {hh}x{ww} grid")
        add = votes.new_zeros(hh * ww, 1, 4, 4)
        add[:, 0, :2, 3] = centres.to(votes.dtype)  # centres[:, 0] into V[0, 3], centres[:, 1] into V[1, 3]
        votes = votes + add
    return votes.reshape(b, 1, weight.shape[0], hh * ww * t, 16)


def _field_positions(height: int, width: int, kernel_size: int, stride: int) -> torch.Tensor:
    """Child positions (row·width + col) in each parent's K×K field  [P, K·K], parents row-major."""
    out_h = (height - kernel_size) // stride + 1
    out_w = (width - kernel_size) // stride + 1
    rows = torch.arange(out_h).view(-1, 1, 1, 1) * stride + torch.arange(kernel_size).view(1, 1, -1, 1)
    cols = torch.arange(out_w).view(1, -1, 1, 1) * stride + torch.arange(kernel_size).view(1, 1, 1, -1)
    return (rows * width + cols).reshape(out_h * out_w, kernel_size * kernel_size)


class CapsuleFields:
    """A convolutional capsule layer's grid: the output grid of a K×K kernel at a stride, and the children in each
    parent's field, cached per input grid (EM's ConvCaps and VB's VBConvCaps share it)."""

    in_types: int
    out_types: int
    kernel_size: int
    stride: int
    iterations: int
    _index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]]

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, out_types={self.out_types}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, iterations={self.iterations}"
        )

    def output_grid(self, height: int, width: int) -> tuple[int, int]:
        k, s = self.kernel_size, self.stride
        return (height - k) // s + 1, (width - k) // s + 1

    def fields(self, poses: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(H', W', field positions [P·K·K], child index of each slot [P, K·K·T_in]) for poses [B, H, W, T, 16]:
        ValueError for another number of types, or a grid smaller than the kernel."""
        _, hh, ww, t, _ = poses.shape
        if t != self.in_types:
            raise ValueError(f"{type(self).__name__} expects {self.in_types} capsule types, got {t}")
        out_h, out_w = self.output_grid(hh, ww)
        if out_h < 1 or out_w < 1:
            k = self.kernel_size
            raise ValueError(f"a {hh}x{ww} capsule grid is smaller than the {k}x{k} kernel")
        key = (hh, ww, str(poses.device))
        if key not in self._index_cache:
            pos, child = field_indices(hh, ww, self.kernel_size, self.stride, self.in_types)
            self._index_cache[key] = (pos.to(poses.device), child.to(poses.device))
        return out_h, out_w, *self._index_cache[key]


class ConvCaps(CapsuleFields, _CentredActivations):
    """A convolutional capsule layer (§3, ConvCaps1/2): each parent at each output position is routed by EM from
    the K×K×T_in children in its receptive field; W_ij depends on the kernel offset, the child type and the parent
    type and is shared across positions. R_ij is normalised over every parent a child reaches, at all positions.
    `fast` (default True): the votes are formed inside the routing a few images at a time (`em_conv`); False: all at
    once, then `em_routing` (the same result up to rounding; a graph torch.export can trace for any batch size).

    Parameters: K·K·T_in·T_out·16 (W) + 2·T_out (β_u, β_a)."""

    def __init__(
        self,
        in_types: int,
        out_types: int,
        *,
        kernel_size: int = 3,
        stride: int = 1,
        iterations: int = 3,
        final_lambda: float = FINAL_LAMBDA,
        min_var: float = MIN_VAR,
        weight_std: float = 1.0,
        centre_activations: bool = False,
    ):
        super().__init__()
        self.in_types, self.out_types = in_types, out_types
        self.kernel_size, self.stride = kernel_size, stride
        self.iterations, self.final_lambda, self.min_var = iterations, final_lambda, min_var
        n_slots = kernel_size * kernel_size * in_types
        # W_ij  [J, I, 4, 4] with I = (kernel offset, child type); std ½ keeps Var V = 4 Var M Var W = Var M
        self.weight = nn.Parameter(torch.randn(out_types, n_slots, 4, 4) * weight_std / 2.0)
        self.beta_u = nn.Parameter(torch.zeros(out_types))
        self.beta_a = nn.Parameter(torch.zeros(out_types))
        self._index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._setup_centring(centre_activations)
        self.fast = True

    def route(self, poses: torch.Tensor, activations: torch.Tensor) -> tuple[EMResult, tuple[int, int]]:
        """The EM result [B, P, J, ...] and the output grid, for poses [B, H, W, T, 16], activations [B, H, W, T]."""
        _, hh, ww, t, _ = poses.shape
        out_h, out_w, pos, child = self.fields(poses)
        p = out_h * out_w
        m, a = gather_fields(poses, activations, pos, p)  # the children in each field  [B, P, I, 4, 4], [B, P, I]
        options: dict[str, Any] = {
            "iterations": self.iterations,
            "final_lambda": self.final_lambda,
            "child_index": child,
            "n_children": hh * ww * t,
            "min_var": self.min_var,
        }
        if self.fast:  # EM on the votes V_ij = M_i W_ij  [B, P, J, I, 16], formed a few images at a time (em_conv)
            res = conv_em_routing(m, self.weight, a, self.beta_u, self.beta_a, **options)
        else:  # the votes of the whole batch, materialised  [B, P, J, I, 16]
            res = em_routing(field_votes(m, self.weight), a, self.beta_u, self.beta_a, **options)
        return res, (out_h, out_w)

    def forward(self, poses: torch.Tensor, activations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """poses [B, H, W, T_in, 16], activations [B, H, W, T_in] -> [B, H', W', T_out, 16], [B, H', W', T_out]."""
        self._centre(lambda: self.route(poses, activations)[0])
        res, (out_h, out_w) = self.route(poses, activations)
        b = poses.shape[0]
        return res.poses.reshape(b, out_h, out_w, self.out_types, 16), res.activations.reshape(b, out_h, out_w, -1)


class ClassCaps(_CentredActivations):
    """Class capsules (§3): every child on the H×W grid votes for each of the n classes with one W per
    (child type, class), shared across positions. Coordinate addition: a scaled position of each child is added to
    the first two elements of the right-hand column of its vote matrix: `centres[:, 0]` to V_ij[0, 3] and
    `centres[:, 1]` to V_ij[1, 3] (None switches it off; EMCapsNet's `coordinate_style` chooses the values).

    Parameters: T_in·n·16 (W) + 2·n (β_u, β_a)."""

    centres: torch.Tensor | None  # a buffer: the coordinates added to the votes, or None without coordinate addition

    def __init__(
        self,
        in_types: int,
        n_classes: int,
        *,
        iterations: int = 3,
        final_lambda: float = FINAL_LAMBDA,
        min_var: float = MIN_VAR,
        centres: torch.Tensor | None = None,
        weight_std: float = 1.0,
        centre_activations: bool = False,
    ):
        super().__init__()
        self.in_types, self.n_classes = in_types, n_classes
        self.iterations, self.final_lambda, self.min_var = iterations, final_lambda, min_var
        self.weight = nn.Parameter(torch.randn(n_classes, in_types, 4, 4) * weight_std / 2.0)  # W_j,type  [J, T, 4, 4]
        self.beta_u = nn.Parameter(torch.zeros(n_classes))
        self.beta_a = nn.Parameter(torch.zeros(n_classes))
        # the values added to V[0, 3], V[1, 3] at each position (row-major)  [H·W, 2]; not a parameter
        self.register_buffer("centres", centres, persistent=False)
        self._setup_centring(centre_activations)

    def extra_repr(self) -> str:
        return (
            f"in_types={self.in_types}, n_classes={self.n_classes}, iterations={self.iterations}, "
            f"coordinate_addition={self.centres is not None}"
        )

    def forward(self, poses: torch.Tensor, activations: torch.Tensor) -> EMResult:
        """poses [B, H, W, T, 16], activations [B, H, W, T] -> EMResult with P = 1: poses [B, 1, n, 16],
        activations [B, 1, n], assignments R [B, 1, n, H·W·T] (children position-major, type-minor)."""
        self._centre(lambda: self.route(poses, activations))
        return self.route(poses, activations)

    def route(self, poses: torch.Tensor, activations: torch.Tensor) -> EMResult:
        b, hh, ww, t, _ = poses.shape
        if t != self.in_types:
            raise ValueError(f"ClassCaps expects {self.in_types} capsule types, got {t}")
        votes = class_votes(poses, self.weight, self.centres)  # [B, 1, J, H·W·T, 16]
        a = activations.reshape(b, 1, hh * ww * t)
        return em_routing(
            votes,
            a,
            self.beta_u,
            self.beta_a,
            iterations=self.iterations,
            final_lambda=self.final_lambda,
            min_var=self.min_var,
        )
