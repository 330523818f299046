"""Self-routing capsule network (Hahn, Pyeon & Kim, NeurIPS 2019) on a ResNet-20 backbone.

The CIFAR-10 / SVHN model of the paper, as the authors released it (github.com/coder3000/SR-CapsNet,
models/resnet.py with the defaults of config.py: 16 planes, 32 capsule types of 16 = 4×4 poses, depth 1). ResNet-20
(He et al. 2016, §4.2: a 3×3 stem of 16 channels, then three stages of `resnet_blocks` basic blocks with 16, 32 and
64 channels, strides 1, 2, 2, and parameter-free zero-padded identity shortcuts, "option A") keeps its features and
drops its pooling and classifier; capsule layers take their place:

    primary caps  3×3 convolutions (padding 1, no bias) + BatchNorm: 32 types of 4×4 pose matrices, and their
                  activations a_i = sigmoid(BatchNorm(conv))                               [B, 32, 8, 8]
    class caps    self-routing (capsnet.routing.self_routing) from every primary capsule (32·8·8 = 2,048) to 10
                  capsules; their activations (a distribution over the classes, since the routing weights sum to 1
                  over the parents) are the class probabilities. This layer computes no poses (`capsules` holds the
                  activations, [B, 10, 1]), so its only weights are W^route and b^route.

trained with the negative log-likelihood of the class activations. `capsule_types` / `capsule_strides` insert
convolutional self-routing layers (3×3, no padding, 4×4 pose matrices) between the two, an extension: the authors'
deeper variants (`--depth` > 1) pad their capsule convolutions, BatchNorm their poses and vote with full 16×16
matrices.

Parameters on 32×32 RGB images, derived layer by layer in tests/test_routing_models.py: ResNet-20 without its
classifier 269,072; primary poses 294,912 + 1,024, activations 18,432 + 64; class caps 327,680 + 20,480;
total 931,664. (The paper's own parameter table could not be read for this check; the figure is the one the
authors' code builds.)

Configs saved before `shortcut` and `primary_batchnorm` existed describe the earlier layout (1×1 convolution +
BatchNorm shortcuts, a biased pose convolution without BatchNorm); `saved_defaults` keeps them loading as saved.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.self_routing_capsnet import SelfRoutingCapsNetConfig
from ..nn.losses import full_precision
from ..nn.standardize import per_image_standardize
from ..routing.self_routing import SelfRoutingConv, SelfRoutingFC
from .capsnet import CapsNetOutput
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model


class _ZeroPadShortcut(nn.Module):
    """He et al.'s option A: subsample by the stride and zero-pad the new channels on both sides (no parameters)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.stride, self.pad_lo, self.pad_hi = stride, (c_out - c_in) // 2, c_out - c_in - (c_out - c_in) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad_lo, self.pad_hi))  # [B, C_out, H', W']


class _BasicBlock(nn.Module):
    """ResNet basic block: two 3×3 conv + BatchNorm and a shortcut, identity unless the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, shortcut: str):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Sequential()
        if (stride != 1 or c_in != c_out) and shortcut == "identity":
            self.shortcut = _ZeroPadShortcut(c_in, c_out, stride)
        elif stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


@register_model
class SelfRoutingCapsNet(Pretrained, nn.Module):
    """Self-routing capsules on a ResNet-20 backbone (Hahn et al. 2019): 931,664 parameters on CIFAR-10."""

    config_class = SelfRoutingCapsNetConfig
    model_type = "self-routing-capsnet"
    paper = "Hahn, Pyeon & Kim, NeurIPS 2019"
    designed_for = "CIFAR-10 32x32 RGB (also SVHN)"
    routing_method = "self-routing"  # what `capsnet visualize` names the routing figure after
    default_lr = 1e-3
    # config.json files written before these keys existed hold the earlier layout (and, before the config
    # recorded its data, none of its runs read digit-style images)
    saved_defaults: ClassVar[dict[str, Any]] = {"shortcut": "projection", "primary_batchnorm": False, "digits": False}

    def __init__(self, *, config: SelfRoutingCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        w = cfg.resnet_widths
        layers: list[nn.Module] = [
            nn.Conv2d(cfg.in_channels, w[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(w[0]),
            nn.ReLU(inplace=True),
        ]
        c_in = w[0]
        for stage, width in enumerate(w):
            for block in range(cfg.resnet_blocks):
                layers.append(_BasicBlock(c_in, width, 2 if stage > 0 and block == 0 else 1, cfg.shortcut))
                c_in = width
        self.backbone = nn.Sequential(*layers)
        t, td, bias = cfg.primary_types, cfg.primary_types * cfg.pose_dim, not cfg.primary_batchnorm
        pose_conv = nn.Conv2d(c_in, td, 3, padding=1, bias=bias)  # (the earlier layout: biased, no BatchNorm)
        self.primary_pose = nn.Sequential(pose_conv, nn.BatchNorm2d(td)) if cfg.primary_batchnorm else pose_conv
        self.primary_act = nn.Sequential(nn.Conv2d(c_in, t, 3, padding=1, bias=bias), nn.BatchNorm2d(t))
        types = (cfg.primary_types, *cfg.capsule_types)
        self.capsules = nn.ModuleList(
            [
                SelfRoutingConv(t_in, t_out, cfg.pose_dim, cfg.pose_dim, 3, s, matrix_pose=True)
                for t_in, t_out, s in zip(types, types[1:], cfg.capsule_strides, strict=False)
            ]
        )
        n_in = types[-1] * cfg.grids[-1] ** 2
        self.class_caps = SelfRoutingFC(
            n_in, cfg.n_classes, cfg.pose_dim, cfg.pose_dim, matrix_pose=True, pose_out=False
        )  # only its activations are read

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet.
        `lengths` are the class capsules' activations (summing to 1), `capsules` the same as [B, n_classes, 1];
        `coupling` the class layer's c_ij."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="SelfRoutingCapsNet")
        x = self.backbone(per_image_standardize(images) if cfg.standardize else images)
        pose = self.primary_pose(x)
        b, _, h, w = pose.shape
        pose = pose.view(b, cfg.primary_types, cfg.pose_dim, h, w).permute(0, 1, 3, 4, 2)  # [B, T, H, W, d]
        a = torch.sigmoid(self.primary_act(x))  # primary activations a_i  [B, T, H, W]
        for layer in self.capsules:
            pose, a = layer(pose, a)
        routed = self.class_caps(pose, a, return_weights=True)
        probs = full_precision(routed.activations)  # a_j, a distribution over the classes  [B, n_classes]
        return CapsNetOutput(
            routed.capsules, probs, probs.argmax(dim=1), None, routed.weights if return_coupling else None
        )

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Negative log-likelihood of the true class's activation. Returns (total, parts as detached tensors)."""
        nll = F.nll_loss(out.lengths.clamp_min(1e-12).log(), labels.long())
        return nll, {"nll": nll.detach(), "total": nll.detach()}
