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

`backbone="resnet"` is their ResNet backbone instead (their README's CIFAR-10 runs): a 3×3 convolution to 64
channels with BatchNorm and ReLU, 3 basic blocks of 64 and 4 of `stem_channels` (the first with stride 2, 1×1
projection shortcuts where the shape changes). The other options follow their code (docs/fidelity.md): the
agreement scaled by 1/√d (the default), their per-channel input normalisation (`input_mean`, `input_std`) and, for
their checkpoints only, their convolutional capsules' window expansion (`conv_windows="released"`).
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.inverted_attention_capsnet import InvertedAttentionCapsNetConfig
from ..nn.losses import full_precision
from ..nn.standardize import per_image_standardize
from ..routing.inverted_attention import InvertedAttentionConv, InvertedAttentionFC, concurrent_routing
from .capsnet import CapsNetOutput
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model
from .self_routing_capsnet import _BasicBlock

RESNET_STEM, RESNET_BLOCKS = 64, (3, 4)  # the authors' resnet_backbone: 64-channel stem, 3 + 4 basic blocks


@register_model
class InvertedAttentionCapsNet(Pretrained, nn.Module):
    """Tsai et al.'s capsule network with inverted dot-product attention routing (492,177 parameters on CIFAR-10)."""

    config_class = InvertedAttentionCapsNetConfig
    model_type = "inverted-attention-capsnet"
    paper = "Tsai, Srivastava, Goh & Salakhutdinov, ICLR 2020"
    designed_for = "CIFAR-10 32x32 RGB"
    routing_method = "inverted-attention"  # what `capsnet visualize` names the routing figure after
    default_lr = 1e-3
    # On data of one's own an epoch takes at least 400 steps, twice the loop's 200: the shapes set's test accuracy
    # rises from 92.2 ± 5.1% (seed 1 at 86.3%) to 98.0 ± 0.3% (seeds 0-2; docs/training.md, "What learns a folder of
    # one's own"). Recorded recipes (CIFAR-10, MNIST, ...) keep one pass an epoch.
    own_data_epoch_steps = 400
    input_mean: torch.Tensor  # buffers [1, C, 1, 1], present when the config normalises the input
    input_std: torch.Tensor
    # config.json files written before `agreement_scale` existed used Eq. 2 as printed (no factor), and before
    # the config recorded its data, none of its runs read digit-style images
    saved_defaults: ClassVar[dict[str, Any]] = {"agreement_scale": 1.0, "digits": False}

    def __init__(self, *, config: InvertedAttentionCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        self.backbone = backbone(cfg)
        self.primary = nn.Conv2d(cfg.stem_channels, cfg.primary_types * cfg.pose_dim, 1, bias=False)
        self.primary_norm = nn.LayerNorm(cfg.pose_dim)
        if cfg.input_mean:  # (x - mean) / std per channel, as the authors' transforms.Normalize
            self.register_buffer("input_mean", torch.tensor(cfg.input_mean).view(1, -1, 1, 1), persistent=False)
            self.register_buffer("input_std", torch.tensor(cfg.input_std).view(1, -1, 1, 1), persistent=False)
        types = (cfg.primary_types, *cfg.capsule_types)
        scale = cfg.scale
        layers: list[nn.Module] = [
            InvertedAttentionConv(
                t_in, t_out, cfg.pose_dim, 3, s, cfg.routing_iterations, agreement_scale=scale, windows=cfg.conv_windows
            )
            for t_in, t_out, s in zip(types, types[1:], cfg.capsule_strides, strict=False)
        ]
        n_in = types[-1] * cfg.grids[-1] ** 2
        layers.append(
            InvertedAttentionFC(
                n_in,
                cfg.n_classes,
                cfg.pose_dim,
                cfg.pose_dim,
                cfg.routing_iterations,
                matrix_pose=True,
                agreement_scale=scale,
            )
        )
        self.capsules = nn.ModuleList(layers)
        self.classifier = nn.Linear(cfg.pose_dim, 1)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet.
        `coupling` is the class layer's routing weights r [B, n_in, n_classes] when asked for."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="InvertedAttentionCapsNet")
        if cfg.standardize:
            images = per_image_standardize(images)
        if cfg.input_mean:
            images = (images - self.input_mean.to(images.dtype)) / self.input_std.to(images.dtype)
        x = self.primary(F.relu(self.backbone(images)))  # [B, T·d, H, W] (resnet: the ReLU is its own)
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


def backbone(cfg: InvertedAttentionCapsNetConfig) -> nn.Module:
    """The features the primary capsules read, [B, stem_channels, grid, grid]: one 3×3 stride-2 convolution (its
    ReLU applied in forward), or the authors' ResNet backbone."""
    if cfg.backbone == "simple":
        return nn.Conv2d(cfg.in_channels, cfg.stem_channels, 3, stride=2, padding=1)
    stem = [nn.Conv2d(cfg.in_channels, RESNET_STEM, 3, padding=1, bias=False), nn.BatchNorm2d(RESNET_STEM), nn.ReLU()]
    blocks, c_in = [], RESNET_STEM
    for width, n, stride in zip((RESNET_STEM, cfg.stem_channels), RESNET_BLOCKS, (1, 2), strict=True):
        for k in range(n):
            blocks.append(_BasicBlock(c_in, width, stride if k == 0 else 1, "projection"))
            c_in = width
    return nn.Sequential(*stem, *blocks)
