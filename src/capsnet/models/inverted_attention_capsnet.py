"""Tsai, Srivastava, Goh & Salakhutdinov (ICLR 2020): the CIFAR-10 capsule network with the "simple" backbone.

Architecture (the authors' published CIFAR-10 configuration; the paper's Fig. 1 draws the general form, which
has one more fully connected capsule layer before the class capsules):

    backbone      conv 3×3, 3 → 128, stride 2, padding 1, ReLU                32 → 16
    primary caps  conv 1×1, 128 → 32·16 (no bias); 32 capsule types of 4×4 pose matrices, LayerNorm over the 16
    conv caps     32 → 32 types, 3×3, stride 2, inverted dot-product attention routing      16 → 7
    conv caps     32 → 32 types, 3×3, stride 1                                               7 → 5
    class caps    fully connected, 32·5·5 = 800 → 10 capsules
    classifier    one linear layer 16 → 1 shared by the class capsules: the class logits, then softmax + cross entropy

Routing runs concurrently through the three capsule layers (§2.2), `routing_iterations` passes (the first one
uniform). Parameters on 32×32 RGB images, derived layer by layer (LayerNorm: γ and β of 16):

    backbone 3·3·3·128 + 128 = 3,584;  primary 128·512 = 65,536 + LayerNorm 32
    conv caps 3·3·32·32·(4·4) = 147,456 + 32, twice;  class caps 800·10·16 = 128,000 + 32;  classifier 16 + 1
    total 492,177

Checked layer by layer against the authors' release (github.com/apple/ml-capsules-inverted-attention-routing:
configs/resnet_backbone_CIFAR10.json run with `--backbone simple`, src/layers.py, src/capsule_model.py): the same
layers and weight shapes, and their count includes the LayerNorms' γ and β as this one does. The paper's Table 1
could not be read for this check. (The released CIFAR-100 configuration differs: 6×6 poses and an extra fully
connected capsule layer of 20.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..nn.losses import full_precision
from ..nn.primary import conv_output_size
from ..routing.inverted_attention import InvertedAttentionConv, InvertedAttentionFC, concurrent_routing
from .capsnet import CapsNetOutput
from .inputs import check_capsule_layers, check_images
from .pretrained import Pretrained


@dataclass
class InvertedAttentionCapsNetConfig:
    """Hyper-parameters of :class:`InvertedAttentionCapsNet`; defaults: Tsai et al.'s CIFAR-10 simple-backbone model."""

    in_channels: int = field(default=3, metadata={"help": "input image channels"})
    image_size: int = field(default=32, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules)"})
    stem_channels: int = field(default=128, metadata={"help": "channels of the backbone's 3x3 stride-2 convolution"})
    primary_types: int = field(default=32, metadata={"help": "primary capsule types"})
    pose_dim: int = field(default=16, metadata={"help": "capsule pose size (a square: 16 = 4x4 matrices)"})
    capsule_types: tuple[int, ...] = field(default=(32, 32), metadata={"help": "types of each conv capsule layer"})
    capsule_strides: tuple[int, ...] = field(default=(2, 1), metadata={"help": "their strides (3x3 kernels)"})
    routing_iterations: int = field(default=2, metadata={"help": "routing iterations r"})
    concurrent: bool = field(
        default=True, metadata={"help": "route all capsule layers concurrently (paper) or one by one"}
    )
    # Eq. 2 of the paper has no factor; the authors' released code multiplies the agreement by 1/√d (0.25 here).
    agreement_scale: float = field(
        default=1.0, metadata={"help": "factor on the agreement p_j.v_ij (1: the paper; 0.25: the authors' code)"}
    )

    def __post_init__(self) -> None:
        self.capsule_types, self.capsule_strides = tuple(self.capsule_types), tuple(self.capsule_strides)
        names = ("in_channels", "image_size", "n_classes", "stem_channels", "primary_types", "pose_dim",
                 "routing_iterations")  # fmt: skip
        for name in names:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.agreement_scale > 0:
            raise ConfigError(f"agreement_scale must be > 0, got {self.agreement_scale}")
        check_capsule_layers(self)

    @property
    def grids(self) -> list[int]:
        """Side of each capsule grid: primary, then after each conv capsule layer (32 → 16, 7, 5)."""
        sizes = [conv_output_size(self.image_size + 2, 3, 2)]  # the backbone: 3×3, stride 2, padding 1
        for s in self.capsule_strides:
            sizes.append(conv_output_size(sizes[-1], 3, s))
        return sizes


class InvertedAttentionCapsNet(Pretrained, nn.Module):
    """Tsai et al.'s capsule network with inverted dot-product attention routing (492,177 parameters on CIFAR-10)."""

    config_class = InvertedAttentionCapsNetConfig
    model_type = "inverted-attention-capsnet"
    paper = "Tsai, Srivastava, Goh & Salakhutdinov, ICLR 2020"
    designed_for = "CIFAR-10 32x32 RGB"
    routing_method = "inverted-attention"  # what `capsnet visualize` names the routing figure after
    default_lr = 1e-3

    def __init__(self, *, config: InvertedAttentionCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        self.backbone = nn.Conv2d(cfg.in_channels, cfg.stem_channels, 3, stride=2, padding=1)
        self.primary = nn.Conv2d(cfg.stem_channels, cfg.primary_types * cfg.pose_dim, 1, bias=False)
        self.primary_norm = nn.LayerNorm(cfg.pose_dim)
        types = (cfg.primary_types, *cfg.capsule_types)
        scale = cfg.agreement_scale
        layers: list[nn.Module] = [
            InvertedAttentionConv(t_in, t_out, cfg.pose_dim, 3, s, cfg.routing_iterations, agreement_scale=scale)
            for t_in, t_out, s in zip(types, types[1:], cfg.capsule_strides, strict=False)
        ]
        n_in = types[-1] * cfg.grids[-1] ** 2
        layers.append(InvertedAttentionFC(n_in, cfg.n_classes, cfg.pose_dim, cfg.pose_dim, cfg.routing_iterations,
                                          matrix_pose=True, agreement_scale=scale))  # fmt: skip
        self.capsules = nn.ModuleList(layers)
        self.classifier = nn.Linear(cfg.pose_dim, 1)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet.
        `coupling` is the class layer's routing weights r [B, n_in, n_classes] when asked for."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="InvertedAttentionCapsNet")
        x = self.primary(F.relu(self.backbone(images)))  # [B, T·d, H, W]
        b, _, h, w = x.shape
        u = x.view(b, cfg.primary_types, cfg.pose_dim, h, w).permute(0, 1, 3, 4, 2)  # [B, T, H, W, d]
        u = self.primary_norm(u)  # primary capsules: LayerNorm over each pose
        if cfg.concurrent:
            poses, r = concurrent_routing(list(cast(Any, self.capsules)), u, cfg.routing_iterations)
            v = poses[-1]
        else:  # sequential: each layer routes to convergence before the next
            for layer in self.capsules[:-1]:
                u = layer(u)
            v, r = self.capsules[-1](u.flatten(1, 3), return_weights=True)
        logits = self.classifier(v).squeeze(-1)  # [B, n_classes]
        probs = full_precision(logits).softmax(dim=1)
        return CapsNetOutput(v, probs, probs.argmax(dim=1), None, r if return_coupling else None)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross entropy of the class logits (the paper's loss). Returns (total, parts as detached tensors)."""
        ce = F.nll_loss(out.lengths.clamp_min(1e-12).log(), labels.long())
        return ce, {"cross_entropy": ce.detach(), "total": ce.detach()}
