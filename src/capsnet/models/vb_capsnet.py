"""Capsule routing via variational Bayes (Ribeiro, Leontidis & Kollias, AAAI 2020): the authors' smallNORB network
as released (fabio-deep/Variational-Capsule-Routing, capsnet.py `CapsuleNet` with main.py's defaults, `--arch
64 8 16 16 5`, 3 routing iterations; README: 98.7% test accuracy on smallNORB):

    5×5 conv (A = 64, stride 2, no bias) + BatchNorm + ReLU          32×32 → 14×14
    PrimaryCaps (B = 8 types, 1×1, BatchNorm'd poses, activations)    14×14
    ConvCaps1 (C = 16, K = 3, stride 2) + VB routing                  6×6
    ConvCaps2 (D = 16, K = 3, stride 1) + VB routing                  4×4
    ClassCaps (one per class, W shared across positions, coordinate addition) + VB routing

each routed layer batch-normalising its poses and activation logits (capsnet.routing.vb.VBNorm). The class
activations a_j = sigmoid(BN(â_j)) are the class scores; the loss is their cross-entropy, F.cross_entropy(a, y), as
the authors' train.py computes it (the sigmoid outputs taken as logits). Their input: smallNORB resized to 48×48,
random 32×32 crops in training and the centre crop at test, each image standardised per channel
(`data_recipes`: crop=32,standardize; docs/fidelity.md on the difference).

Parameters on 32×32 stereo pairs: conv 3,200 + BN 128; primary 8,192 + 512 + BN 32; ConvCaps1 18,432 + 32;
ConvCaps2 36,864 + 32; ClassCaps 1,280 + 10; total 68,714 (the authors' CapsuleNet builds the same number:
tests/test_vb_authors.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.vb_capsnet import VBCapsNetConfig
from ..nn.losses import full_precision
from ..nn.standardize import per_image_standardize
from ..routing.vb import VBPrior
from ..routing.vb_conv import VBClassCaps, VBConvCaps, VBPrimaryCaps
from .capsnet import CapsNetOutput
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model


def class_coordinates(config: VBCapsNetConfig) -> torch.Tensor | None:
    """What the class votes get added at each position of the g×g grid (row-major) in V[0, 3] and V[1, 3] [g², 2]:
    ((row + 1)/(10 g), (col + 1)/(10 g)) for "positions"; for "authors" the same formula with the class layer's
    1×1 output grid in place of the input grid, as their code computes it: 0.1 everywhere; None for "none"."""
    g = config.class_grid
    if config.coordinates == "none":
        return None
    if config.coordinates == "authors":
        return torch.full((g * g, 2), 0.1)
    coord = (torch.arange(g, dtype=torch.float32) + 1.0) / (10.0 * g)
    rows, cols = torch.meshgrid(coord, coord, indexing="ij")
    return torch.stack([rows, cols], dim=-1).reshape(g * g, 2)


@register_model
class VBCapsNet(Pretrained, nn.Module):
    """The authors' smallNORB network with VB routing: 68,714 parameters (A=64, B=8, C=D=16, 5 classes, 2 channels).
    Options mirror `VBCapsNetConfig`."""

    config_class = VBCapsNetConfig
    model_type = "vb-capsnet"
    paper = "Ribeiro, Leontidis & Kollias, AAAI 2020 (Capsule Routing via Variational Bayes)"
    designed_for = "smallNORB 32x32 crops of 48x48 stereo pairs (also MNIST 28x28)"
    routing_method = "variational-bayes"  # what `capsnet visualize` names the routing figure after
    default_lr = 1e-3  # the authors' Adam, weight decay 0, batch 128
    # On data of one's own an epoch takes at least 400 steps, twice the loop's 200: the shapes set's test accuracy
    # rises from 96.0 and 87.3% (seeds 0, 1) to 98.7 ± 0.7% (seeds 0-2; docs/training.md, "What learns a folder of
    # one's own"). Recorded recipes (smallNORB, MNIST, ...) keep one pass an epoch.
    own_data_epoch_steps = 400
    data_recipes: ClassVar[dict[str, dict[str, str]]] = {"smallnorb": {"augment": "crop=32,standardize"}}

    def __init__(self, *, config: VBCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        vb = {
            "iterations": cfg.routing_iterations,
            "prior": VBPrior(alpha0=cfg.alpha0, kappa0=cfg.kappa0, nu0=cfg.nu0, psi0=cfg.psi0),
            "min_normaliser": cfg.min_normaliser,
        }
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.conv_channels, 5, stride=2, bias=False)
        nn.init.kaiming_uniform_(self.conv1.weight)
        self.bn1 = nn.BatchNorm2d(cfg.conv_channels)
        self.primary = VBPrimaryCaps(cfg.conv_channels, cfg.primary_types)
        self.caps1 = VBConvCaps(cfg.primary_types, cfg.caps1_types, kernel_size=3, stride=2, **vb)
        self.caps2 = VBConvCaps(cfg.caps1_types, cfg.caps2_types, kernel_size=3, stride=1, **vb)
        self.classes = VBClassCaps(cfg.caps2_types, cfg.n_classes, centres=class_coordinates(cfg), **vb)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet. `lengths`
        are the class activations a_j [B, n] (each in (0, 1)), `capsules` the class poses [B, n, 16], `coupling` the
        class layer's final R_ij [B, D·g², n] (type-major, like CapsNet's)."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="VBCapsNet")
        x = per_image_standardize(images) if cfg.standardize else images
        m, a = self.primary(F.relu(self.bn1(self.conv1(x))))  # [B, 14, 14, B_types, 16], [B, 14, 14, B_types]
        m, a = self.caps1(m, a)  # [B, 6, 6, C, 16]
        m, a = self.caps2(m, a)  # [B, 4, 4, D, 16]
        poses, acts, res = self.classes(m, a)  # [B, n, 16], [B, n]
        acts = full_precision(acts)
        coupling = None
        if return_coupling:  # R [B, 1, n, g²·D] (position-major) -> [B, D·g², n] (type-major)
            b, g2, d = images.shape[0], cfg.class_grid**2, cfg.caps2_types
            coupling = res.assignments[:, 0].reshape(b, -1, g2, d).permute(0, 3, 2, 1).reshape(b, d * g2, -1)
        return CapsNetOutput(poses, acts, acts.argmax(dim=1), None, coupling)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The authors' loss: cross-entropy of the class activations taken as logits. Returns (total, parts)."""
        total = F.cross_entropy(out.lengths, labels.long())
        return total, {"cross_entropy": total.detach(), "total": total.detach()}
