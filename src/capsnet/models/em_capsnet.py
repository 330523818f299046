"""Matrix capsules with EM routing (Hinton, Sabour & Frosst, ICLR 2018), the paper's smallNORB network (§4, Fig. 1):
5×5 conv (A channels, stride 2, ReLU) → PrimaryCaps (B types, 1×1) → ConvCaps1 (C types, K=3, stride 2) →
ConvCaps2 (D types, K=3, stride 1) → Class capsules (one per class, coordinate addition, shared weights).

On 32×32 smallNORB crops the grids are 32 → 14 → 14 → 6 → 4; on 28×28 MNIST 28 → 12 → 12 → 5 → 3.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.em_capsnet import EMCapsNetConfig
from ..nn.losses import MarginLoss, SpreadLoss, full_precision, spread_margin
from ..nn.standardize import per_image_standardize
from ..routing.matrix_capsules import ClassCaps, ConvCaps, PrimaryMatrixCaps
from .pretrained import Pretrained
from .registry import register_model

# The paper's smaller network (§4: "A=64, B=8, C=D=16", 68K parameters); the defaults are the main one (A=B=C=D=32).
SMALL = {"conv_channels": 64, "primary_types": 8, "caps1_types": 16, "caps2_types": 16}


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
    """Mirrors `capsnet.CapsNetOutput` so that training, evaluation and prediction treat both alike."""

    capsules: torch.Tensor  # class poses M_j, flattened 4×4  [B, n_classes, 16]
    lengths: torch.Tensor  # class activations a_j  [B, n_classes]
    predictions: torch.Tensor  # argmax_j a_j  [B]
    reconstructions: None
    coupling: torch.Tensor | None  # final R_ij of the class layer [B, D·grid², n_classes] (type-major) when asked
    logits: torch.Tensor  # λ (β_a − Σ_h cost_h), a_j = sigmoid(logits)  [B, n_classes]


@register_model
class EMCapsNet(Pretrained, nn.Module):
    """The paper's smallNORB network: 316,394 parameters (A=B=C=D=32, 5 classes), 67,154 for A=64, B=8, C=D=16.

    `EMCapsNet()` builds the main model; `EMCapsNet(**SMALL)` the small one; options mirror `EMCapsNetConfig`.
    """

    config_class = EMCapsNetConfig
    model_type = "em-capsnet"
    train_steps: torch.Tensor  # a buffer: `margin_steps` as saved with the weights
    paper = "Hinton, Sabour & Frosst, ICLR 2018 (Matrix capsules with EM routing)"
    designed_for = "smallNORB 32x32 crops (also MNIST 28x28)"
    # config.json files written before `coordinate_style` existed hold receptive-field coordinates
    saved_defaults: ClassVar[dict[str, Any]] = {"coordinate_style": "receptive-field"}
    routing_method = "em"  # what `capsnet visualize` names the routing figure after
    default_lr = 3e-3  # Adam; the paper gives none (docs/benchmarks.md, EM routing)
    # On one's own data, the paper's small network (SMALL, 5.7x less time a step) for 600 steps an epoch: the main
    # one at 200 steps, and the small one at 400, were still learning after 10 epochs (docs/training.md, "What learns
    # a folder of one's own").
    # Recorded recipes (smallNORB, MNIST, ...) keep the main network and one pass an epoch.
    own_data_options: ClassVar[dict[str, Any]] = dict(SMALL)
    own_data_epoch_steps = 600

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
            # evaluation at the final margin (0.9), so that validation losses of different epochs compare (best/)
            m = self.current_margin() if self.training else spread_margin(1.0)
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
