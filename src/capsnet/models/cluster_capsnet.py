"""Capsule network with non-iterative cluster routing (Zhao & Cheng, Neural Networks 2021): the authors' CIFAR-10
model as their code builds it (github.com/ZHAOZHIHAO/ClusterRouting, src/capsule_network.py `CapsuleNetwork`, with
main.py's defaults C 4, K 8, D 24: their README's CIFAR-10 command).

Five convolutional capsule layers with cluster routing (capsnet.routing.cluster_conv), all 3×3 with padding 1:

    caps 1   the image (3 channels) -> 4 channels of 24-D capsules, stride 1   32×32
    caps 2   4 -> 4 channels, stride 2                                          16×16
    caps 3   4 -> 4, stride 1                                                   16×16
    caps 4   4 -> 4, stride 2                                                    8×8
    caps 5   4 -> 10 channels, one per class, stride 1                           8×8
    classifier  one linear layer 24·8·8 -> 1 shared by the class channels: the class logits, then softmax and
                cross entropy

Each layer's channels are LayerNorm'd over (D, H, W), one γ and β shared by the layer's channels. Parameters on
32×32 RGB images, derived layer by layer (K·C_out·D vote maps per input channel, 3×3, biased):

    caps 1  4·(3·9 + 1)·768 = 86,016 + LayerNorm 2·24·32·32 = 49,152
    caps 2-4  4·(24·9 + 1)·768 = 666,624 each + LayerNorm 12,288, 12,288, 3,072
    caps 5  4·(24·9 + 1)·1,920 = 1,666,560 + LayerNorm 3,072;  classifier 1,537
    total 3,833,857

The authors' `CapsLayerWithClusterRouting` builds one vote convolution per *output* channel and uses one per
*input* channel: their last layer holds 10 and uses 4, so their model counts 6 unused convolutions more (6 ×
416,640: 6,333,697 in all). capsnet builds the ones used (docs/fidelity.md).

Their input recipe (src/datasets_util.py) is `--augment auto` here (`data_recipes`): on CIFAR-10 a random crop with
4 px zero padding, left-right flips, contrast 0.8-1.2 and per-channel standardisation; on SVHN the crop and the
standardisation. Their SGD schedule (lr 0.1, weight decay 5e-4, ×0.1 every 100 of 300 epochs) is not one `capsnet
train` runs: it trains with its Adam at lr 1e-3, batch 64 (theirs).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.cluster_capsnet import ClusterCapsNetConfig
from ..nn.losses import full_precision
from ..nn.standardize import per_image_standardize
from ..routing.cluster_conv import ClusterRoutingConv
from .capsnet import CapsNetOutput
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model


@register_model
class ClusterCapsNet(Pretrained, nn.Module):
    """Zhao & Cheng's capsule network with cluster routing: 3,833,857 parameters on CIFAR-10."""

    config_class = ClusterCapsNetConfig
    model_type = "cluster-capsnet"
    paper = "Zhao & Cheng, Neural Networks 2021"
    designed_for = "CIFAR-10 32x32 RGB (also SVHN)"
    routing_method = "cluster"  # what `capsnet visualize` names the routing figure after
    default_lr = 1e-3
    default_batch_size = 64  # their batch size
    # The authors' input pipelines (src/datasets_util.py) by data format, for `--augment auto`: RandomCrop(32,
    # padding=4), RandomHorizontalFlip, ColorJitter's contrast, Normalize per channel (capsnet.data.imageaug).
    data_recipes: ClassVar[dict[str, dict[str, str]]] = {
        "cifar10": {"augment": "shift=4,zero-fill,flip,contrast=0.8:1.2,channel-standardize"},
        "svhn": {"augment": "shift=4,zero-fill,channel-standardize"},
    }

    def __init__(self, *, config: ClusterCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        n = len(cfg.strides)
        channels = [cfg.capsule_channels] * (n - 1) + [cfg.n_classes]
        ins = [(cfg.capsule_channels, cfg.in_channels)] + [(cfg.capsule_channels, cfg.capsule_dim)] * (n - 1)
        self.capsules = nn.ModuleList(
            [
                ClusterRoutingConv(
                    c_in,
                    c_out,
                    d_in,
                    cfg.capsule_dim,
                    (side, side),
                    votes=cfg.votes,
                    stride=stride,
                    bias=cfg.bias,
                    image_input=layer == 0,
                )
                for layer, ((c_in, d_in), c_out, stride, side) in enumerate(zip(ins, channels, cfg.strides, cfg.grids))
            ]
        )
        self.classifier = nn.Linear(cfg.capsule_dim * cfg.grids[-1] ** 2, 1)  # shared by the class channels

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] (as the input recipe makes them); `labels` is accepted (and unused) so it is called
        like CapsNet. `capsules` are the class channels flattened [B, n_classes, D·H'·W'], `lengths` the softmax of
        the class logits, `coupling` the last layer's routing weights (see `class_coupling`)."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="ClusterCapsNet")
        x = per_image_standardize(images) if cfg.standardize else images
        for layer in self.capsules[:-1]:
            x = layer(x)  # [B, C, D, H', W']
        v, c = self.capsules[-1](x, return_weights=True)  # class channels [B, n_classes, D, 8, 8]
        capsules = v.flatten(2)  # [B, n_classes, D·8·8]
        logits = full_precision(self.classifier(capsules).squeeze(-1))  # [B, n_classes]
        probs = torch.softmax(logits, dim=1)
        coupling = class_coupling(c) if return_coupling else None
        return CapsNetOutput(capsules, probs, probs.argmax(dim=1), None, coupling)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross entropy of the class logits (the authors' F.cross_entropy). Returns (total, parts, detached)."""
        nll = F.nll_loss(out.lengths.clamp_min(1e-30).log(), labels.long())
        return nll, {"nll": nll.detach(), "total": nll.detach()}


def class_coupling(c: torch.Tensor) -> torch.Tensor:
    """The last layer's routing weights c_ij [B, C_in, n_classes, D, H, W] (summing to 1 over the input channels) as
    one weight per child, input channel i at location p, and class: the mean over D, normalised over the classes,
    [B, C_in·H·W, n_classes], summing to 1 over the classes as every routing's weights do."""
    share = c.mean(dim=3).permute(0, 1, 3, 4, 2).flatten(1, 3)  # c̄  [B, C_in·H·W, n_classes]
    return share / share.sum(dim=2, keepdim=True)


__all__ = ["ClusterCapsNet", "class_coupling"]
