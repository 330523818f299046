"""Matrix capsules with EM routing (Hinton, Sabour & Frosst, ICLR 2018), the paper's smallNORB network (§4, Fig. 1):
5×5 conv (A channels, stride 2, ReLU) → PrimaryCaps (B types, 1×1) → ConvCaps1 (C types, K=3, stride 2) →
ConvCaps2 (D types, K=3, stride 1) → Class capsules (one per class, coordinate addition, shared weights).

On 32×32 smallNORB crops the grids are 32 → 14 → 14 → 6 → 4; on 28×28 MNIST 28 → 12 → 12 → 5 → 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..nn.losses import MarginLoss, SpreadLoss, full_precision, spread_margin
from ..nn.standardize import per_image_standardize
from ..routing.em import FINAL_LAMBDA
from ..routing.matrix_capsules import ClassCaps, ConvCaps, PrimaryMatrixCaps
from .inputs import RecordedData
from .pretrained import Pretrained

# The paper's smaller network (§4: "A=64, B=8, C=D=16", 68K parameters); the defaults are the main one (A=B=C=D=32).
SMALL = {"conv_channels": 64, "primary_types": 8, "caps1_types": 16, "caps2_types": 16}


@dataclass
class EMCapsNetConfig(RecordedData):
    """Hyper-parameters of :class:`EMCapsNet`; the defaults are the paper's smallNORB model (A=B=C=D=32)."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=5, metadata={"help": "number of classes (class capsules)"})
    conv_channels: int = field(default=32, metadata={"help": "A: channels of the first convolution"})
    conv_kernel: int = field(default=5, metadata={"help": "kernel of the first convolution (stride 2)"})
    primary_types: int = field(default=32, metadata={"help": "B: primary capsule types"})
    caps1_types: int = field(default=32, metadata={"help": "C: ConvCaps1 capsule types (K=3, stride 2)"})
    caps2_types: int = field(default=32, metadata={"help": "D: ConvCaps2 capsule types (K=3, stride 1)"})
    routing_iterations: int = field(default=3, metadata={"help": "routing iterations r"})
    final_lambda: float = field(
        default=FINAL_LAMBDA, metadata={"help": "EM inverse temperature: lambda_t = final_lambda (1 - 0.95^(t+1))"}
    )
    # σ² floor: 1e-2, not the official code's 5e-4 (routing.em.MIN_VAR): the gradient through the E-step grows as
    # 1/σ², and on the bundled sample r = 3 learned only with the larger floor (docs/benchmarks.md, EM routing).
    min_var: float = field(
        default=1e-2, metadata={"help": "floor of the EM variances sigma^2 (bounds 1/sigma^2 in the gradients)"}
    )
    centre_activations: bool = field(
        default=True, metadata={"help": "start beta_a so that half the capsules are active on the first batch"}
    )
    coordinate_addition: bool = field(default=True, metadata={"help": "add scaled positions to the class votes"})
    # "grid": Gritzman's fc_caps, (col + 1/2)/W into V[0, 3] and (row + 1/2)/H into V[1, 3] on the class layer's
    # input grid; "receptive-field": (row, col) of each position's receptive-field centre in pixels / image size,
    # into V[0, 3], V[1, 3] (the layout of folders whose config.json lacks the key, EMCapsNet.saved_defaults).
    coordinate_style: Literal["grid", "receptive-field"] = field(
        default="grid", metadata={"help": "coordinate addition: grid (the authors') or receptive-field"}
    )
    class_loss: Literal["spread", "margin", "cross_entropy"] = field(
        default="spread", metadata={"help": "loss on the class activations"}
    )
    margin_anneal_steps: int = field(
        default=10000, metadata={"help": "training steps over which the spread loss margin grows from 0.2 to 0.9"}
    )

    def __post_init__(self) -> None:
        ints = ("in_channels", "image_size", "n_classes", "conv_channels", "conv_kernel", "primary_types",
                "caps1_types", "caps2_types", "routing_iterations", "margin_anneal_steps")  # fmt: skip
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_recorded(self.n_classes)
        if self.final_lambda <= 0 or self.min_var <= 0:
            raise ConfigError(f"final_lambda and min_var must be > 0, got {self.final_lambda}, {self.min_var}")
        if self.coordinate_style not in ("grid", "receptive-field"):
            raise ConfigError(f"coordinate_style must be 'grid' or 'receptive-field', got {self.coordinate_style!r}")
        if self.class_grid < 1:
            raise ConfigError(f"image_size {self.image_size} is too small for EMCapsNet's layers")

    def layer_geometry(self) -> list[tuple[int, int]]:
        """(kernel, stride) of the layers that shrink the grid: conv, ConvCaps1, ConvCaps2."""
        return [(self.conv_kernel, 2), (3, 2), (3, 1)]

    @property
    def class_grid(self) -> int:
        """Side of the ConvCaps2 grid the class capsules read: 32 → 14 → 6 → 4."""
        s = self.image_size
        for k, stride in self.layer_geometry():
            s = (s - k) // stride + 1
        return s


def grid_coordinates(config: EMCapsNetConfig) -> torch.Tensor:
    """Gritzman's coordinate addition: for each position (row, col) of the g×g grid the class capsules read
    (row-major), ((col + ½)/g, (row + ½)/g), the values added to V[0, 3] and V[1, 3]  [g², 2]."""
    g = config.class_grid
    coord = (torch.arange(g, dtype=torch.float32) + 0.5) / g
    rows, cols = torch.meshgrid(coord, coord, indexing="ij")
    return torch.stack([cols, rows], dim=-1).reshape(g * g, 2)


def class_coordinates(config: EMCapsNetConfig) -> torch.Tensor | None:
    """The values ClassCaps adds to V[0, 3], V[1, 3] at each position [g², 2], by `coordinate_style`; None without
    coordinate addition."""
    if not config.coordinate_addition:
        return None
    return grid_coordinates(config) if config.coordinate_style == "grid" else receptive_field_centres(config)


def receptive_field_centres(config: EMCapsNetConfig) -> torch.Tensor:
    """(row, col) of the receptive-field centre of each ConvCaps2 position, in image pixels / image_size
    [grid², 2] (row-major). A stack of (k, s) layers maps position y to start + y·jump, with start += (k−1)/2·jump
    and jump *= s per layer, from the centre of pixel 0 (0.5) and jump 1."""
    start, jump = 0.5, 1.0
    for k, s in config.layer_geometry():
        start, jump = start + (k - 1) / 2 * jump, jump * s
    g = config.class_grid
    coord = (start + jump * torch.arange(g, dtype=torch.float32)) / config.image_size
    return torch.stack(torch.meshgrid(coord, coord, indexing="ij"), dim=-1).reshape(g * g, 2)


class EMCapsNetOutput(NamedTuple):
    """Mirrors :class:`capsnet.CapsNetOutput` so that training, evaluation and prediction treat both alike."""

    capsules: torch.Tensor  # class poses M_j, flattened 4×4  [B, n_classes, 16]
    lengths: torch.Tensor  # class activations a_j  [B, n_classes]
    predictions: torch.Tensor  # argmax_j a_j  [B]
    reconstructions: None
    coupling: torch.Tensor | None  # final R_ij of the class layer [B, D·grid², n_classes] (type-major) when asked
    logits: torch.Tensor  # λ (β_a − Σ_h cost_h), a_j = sigmoid(logits)  [B, n_classes]


class EMCapsNet(Pretrained, nn.Module):
    """The paper's smallNORB network: 316,394 parameters (A=B=C=D=32, 5 classes), 67,154 for A=64, B=8, C=D=16.

    `EMCapsNet()` builds the main model; `EMCapsNet(**SMALL)` the small one; options mirror :class:`EMCapsNetConfig`.
    """

    config_class = EMCapsNetConfig
    model_type = "em-capsnet"
    train_steps: torch.Tensor  # a buffer: `margin_steps` as saved with the weights
    paper = "Hinton, Sabour & Frosst, ICLR 2018 (Matrix capsules with EM routing)"
    designed_for = "smallNORB 32x32 crops (also MNIST 28x28)"
    routing_method = "em"  # what `capsnet visualize` names the routing figure after
    default_lr = 3e-3  # Adam; the paper gives none (docs/benchmarks.md, EM routing)
    # config.json files written before `coordinate_style` existed hold receptive-field coordinates
    saved_defaults: ClassVar[dict[str, Any]] = {"coordinate_style": "receptive-field"}

    def __init__(self, *, config: EMCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        em: dict[str, Any] = {
            "iterations": cfg.routing_iterations,
            "final_lambda": cfg.final_lambda,
            "min_var": cfg.min_var,
            "centre_activations": cfg.centre_activations,
        }
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.conv_channels, cfg.conv_kernel, stride=2)
        self.primary = PrimaryMatrixCaps(cfg.conv_channels, cfg.primary_types)
        self.caps1 = ConvCaps(cfg.primary_types, cfg.caps1_types, kernel_size=3, stride=2, **em)
        self.caps2 = ConvCaps(cfg.caps1_types, cfg.caps2_types, kernel_size=3, stride=1, **em)
        self.classes = ClassCaps(cfg.caps2_types, cfg.n_classes, centres=class_coordinates(cfg), **em)
        self.spread_loss = SpreadLoss(cfg.n_classes)
        self.margin_loss = MarginLoss(cfg.n_classes)
        # Training steps seen by `loss`, which drive the spread margin's schedule: counted on the host (`margin_steps`,
        # so that a step never reads the device) and saved as the buffer `train_steps` (written into it by
        # state_dict, read back from it on loading), so a resumed run continues the schedule exactly.
        self.register_buffer("train_steps", torch.zeros((), dtype=torch.long))
        self.margin_steps = 0

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> EMCapsNetOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet."""
        c, s = self.config.in_channels, self.config.image_size
        if images.dim() != 4 or tuple(images.shape[1:]) != (c, s, s):
            raise ValueError(f"EMCapsNet expects images of shape [B, {c}, {s}, {s}], got {list(images.shape)}")
        x = per_image_standardize(images) if self.config.standardize else images
        m, a = self.primary(F.relu(self.conv1(x)))  # [B, 14, 14, B_types, 16], [B, 14, 14, B_types]
        m, a = self.caps1(m, a)  # [B, 6, 6, C, 16]
        m, a = self.caps2(m, a)  # [B, 4, 4, D, 16]
        res = self.classes(m, a)  # P = 1
        poses, acts, logits = res.poses[:, 0], res.activations[:, 0], res.logits[:, 0]
        coupling = None
        if return_coupling:  # R [B, 1, n, grid²·D] (position-major) -> [B, D·grid², n] (type-major, like CapsNet)
            b, g2, d = images.shape[0], self.config.class_grid**2, self.config.caps2_types
            coupling = res.assignments[:, 0].reshape(b, -1, g2, d).permute(0, 3, 2, 1).reshape(b, d * g2, -1)
        return EMCapsNetOutput(poses, acts, acts.argmax(dim=1), None, coupling, logits)

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor) -> None:
        """Centre β_a of every EM layer on one batch of training images [B, C, H, W] in [0, 1] (`centre_activations`;
        layer by layer, each on the activations of the layers below, already centred). Once: a loaded or already
        centred model is left as it is. `capsnet train` calls it before DistributedDataParallel wraps the model, on
        a batch every rank computes alike; without it, the first training forward does the same on its own batch."""
        if not self.config.centre_activations:
            return
        was_training = self.training
        self.train()
        self(images)  # each layer not yet centred centres itself before it routes
        self.train(was_training)

    def current_margin(self) -> float:
        """The spread loss margin m at this point of training (0.2 → 0.9 over `margin_anneal_steps`)."""
        return spread_margin(self.margin_steps / self.config.margin_anneal_steps)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.train_steps.fill_(self.margin_steps)  # (a write to the device, no read)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        steps = state_dict.get(prefix + "train_steps")
        if steps is not None:  # (read once, at load time)
            self.margin_steps = int(steps)

    def loss(
        self, out: EMCapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """The configured class loss on the class activations. Returns (total, parts: the losses as detached 0-d
        tensors, so a training step never waits for the device; the spread margin as a float)."""
        kind = self.config.class_loss
        if kind == "spread":
            m = self.current_margin()
            total = self.spread_loss(full_precision(out.lengths), labels, m)
            parts = {"spread": total.detach(), "spread_margin": m}
            if self.training and torch.is_grad_enabled():
                self.margin_steps += 1
        elif kind == "margin":
            total = self.margin_loss(full_precision(out.lengths), labels)
            parts = {"margin": total.detach()}
        else:
            total = F.cross_entropy(full_precision(out.logits), labels.long())
            parts = {"cross_entropy": total.detach()}
        parts["total"] = total.detach()
        return total, parts
