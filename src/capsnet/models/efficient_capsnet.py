"""Efficient-CapsNet (Mazzia, Salvetti & Chiaberge, Sci. Rep. 11, 14634, 2021): 161,824 parameters on MNIST.

Architecture (the paper's Fig. 1 and MNIST model): four convolutions, each followed by BatchNorm and ReLU, a
depthwise convolution whose kernel covers the whole remaining feature map and whose 128 outputs form 16 primary
capsules of 8 dimensions (squashed with the paper's (1 − e^{−|s|}) s/|s|), and 10 class capsules of 16
dimensions computed by self-attention routing (capsnet.routing.self_attention). A fully connected decoder
reconstructs the input from the masked class capsules, as in CapsNet.

Parameters of the MNIST model, layer by layer (BatchNorm counts its γ and β; its running statistics are buffers):

    conv 5×5, 1 → 32           5·5·1·32 + 32     =     832    BatchNorm 2·32  =    64
    conv 3×3, 32 → 64          3·3·32·64 + 64    =  18,496    BatchNorm 2·64  =   128
    conv 3×3, 64 → 64          3·3·64·64 + 64    =  36,928    BatchNorm 2·64  =   128
    conv 3×3, 64 → 128, s 2    3·3·64·128 + 128  =  73,856    BatchNorm 2·128 =   256
    depthwise 9×9, 128         9·9·128 + 128     =  10,496
    self-attention routing     W 16·10·8·16 = 20,480 + prior b 16·10 = 160
                                                              total         161,824

plus 1,411,344 for the decoder (16·10 → 512 → 1024 → 784), which the paper's count leaves out.
Feature maps: 28 → 24 → 22 → 20 → 9 (stride 2) → 1 (the depthwise kernel is sized to the map: 9 on MNIST).

Training recipe (the paper's MNIST setting, used as this model's defaults): Adam, lr 5e-4 decayed by 0.97 every
epoch, margin loss + 0.392 × the mean squared reconstruction error (0.392 = 0.0005 · 784: the paper's CapsNet
weight on a sum, as a mean). The smallNORB variant is :meth:`EfficientCapsNetConfig.for_smallnorb`; from the
command line (the data set fills in 2 channels, 48×48, 5 classes):

    capsnet train --model efficient-capsnet --dataset SMALLNORB_DIR --backbone-kernels 7 3 3 3 \
        --backbone-strides 2 1 1 2 --backbone-norm instance --backbone-activation leaky-relu

The paper's smallNORB decoder is convolutional; this variant keeps the fully connected one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ..errors import ConfigError
from ..nn.decoder import CapsuleDecoder
from ..nn.losses import MarginLoss, capsule_lengths
from ..nn.primary import conv_output_size
from ..nn.squash import efficient_squash
from ..routing.self_attention import SelfAttentionRouter
from .capsnet import CapsNet, CapsNetOutput
from .inputs import check_images, check_loss_options
from .pretrained import Pretrained


@dataclass
class EfficientCapsNetConfig:
    """Hyper-parameters of :class:`EfficientCapsNet`; the defaults are the paper's MNIST model."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int = field(default=28, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules)"})
    backbone_channels: tuple[int, ...] = field(
        default=(32, 64, 64, 128), metadata={"help": "channels of the backbone convolutions"}
    )
    backbone_kernels: tuple[int, ...] = field(default=(5, 3, 3, 3), metadata={"help": "their kernel sizes"})
    backbone_strides: tuple[int, ...] = field(default=(1, 1, 1, 2), metadata={"help": "their strides"})
    backbone_norm: Literal["batch", "instance"] = field(
        default="batch", metadata={"help": "normalisation after each backbone convolution"}
    )
    backbone_activation: Literal["relu", "leaky-relu"] = field(
        default="relu", metadata={"help": "activation after each backbone normalisation"}
    )
    primary_dim: int = field(default=8, metadata={"help": "primary capsule dimension"})
    class_dim: int = field(default=16, metadata={"help": "class capsule dimension"})
    decoder: bool = field(default=True, metadata={"help": "add the reconstruction decoder"})
    decoder_hidden: tuple[int, ...] = field(default=(512, 1024), metadata={"help": "decoder hidden sizes"})
    decoder_mask: Literal["label", "prediction"] = field(
        default="label", metadata={"help": "capsule the decoder reconstructs in training: true label or prediction"}
    )
    recon_weight: float = field(default=0.392, metadata={"help": "weight of the reconstruction error"})
    recon_reduction: Literal["sum", "mean"] = field(
        default="mean", metadata={"help": "per-image reduction of squared errors"}
    )
    router_init_std: float | None = field(
        default=None, metadata={"help": "initial std of W_ij (default: sqrt(2 / primary_dim))"}
    )

    def __post_init__(self) -> None:
        for name in ("backbone_channels", "backbone_kernels", "backbone_strides", "decoder_hidden"):
            setattr(self, name, tuple(getattr(self, name)))
        for name in ("in_channels", "image_size", "n_classes", "primary_dim", "class_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_loss_options(self)
        layers = (self.backbone_channels, self.backbone_kernels, self.backbone_strides)
        if not self.backbone_channels or len(set(map(len, layers))) != 1 or min(min(x) for x in layers) < 1:
            raise ConfigError("backbone_channels, backbone_kernels and backbone_strides need one positive value "
                              "per convolution, as many of each")  # fmt: skip
        if self.backbone_channels[-1] % self.primary_dim:
            raise ConfigError(f"the last backbone channels ({self.backbone_channels[-1]}) must be a multiple of "
                              f"primary_dim ({self.primary_dim})")  # fmt: skip
        if self.feature_size < 1:
            raise ConfigError(f"image_size {self.image_size} is too small for the backbone convolutions")

    @property
    def feature_size(self) -> int:
        """Side of the last backbone feature map (unpadded convolutions): 28 → 24 → 22 → 20 → 9 on MNIST."""
        s = self.image_size
        for k, stride in zip(self.backbone_kernels, self.backbone_strides, strict=True):
            s = conv_output_size(s, k, stride)
        return s

    @property
    def n_primary(self) -> int:
        return self.backbone_channels[-1] // self.primary_dim

    @classmethod
    def for_smallnorb(cls, **overrides) -> EfficientCapsNetConfig:
        """The paper's smallNORB model: 48×48 stereo pairs (2 channels), 5 classes, a 7×7 stride-2 first
        convolution, instance normalisation and leaky ReLU; feature maps 48 → 21 → 19 → 17 → 8 → 1."""
        preset = dict(
            in_channels=2,
            image_size=48,
            n_classes=5,
            backbone_kernels=(7, 3, 3, 3),
            backbone_strides=(2, 1, 1, 2),
            backbone_norm="instance",
            backbone_activation="leaky-relu",
        )
        return cls(**{**preset, **overrides})


class EfficientCapsNet(Pretrained, nn.Module):
    """Efficient-CapsNet; `EfficientCapsNet()` builds the paper's MNIST model (161,824 parameters without the
    decoder). Options are keyword-only and mirror :class:`EfficientCapsNetConfig`, or pass `config=`."""

    config_class = EfficientCapsNetConfig
    model_type = "efficient-capsnet"
    paper = "Mazzia, Salvetti & Chiaberge, Sci. Rep. 2021"
    designed_for = "MNIST 28x28 (smallNORB variant: EfficientCapsNetConfig.for_smallnorb)"
    routing_method = "self-attention"  # what `capsnet visualize` names the routing figure after
    default_lr = 5e-4  # the paper's Adam learning rate
    default_lr_decay = 0.97  # the paper's exponential decay per epoch

    def __init__(self, *, config: EfficientCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        layers: list[nn.Module] = []
        channels = (cfg.in_channels, *cfg.backbone_channels)
        for c_in, c_out, k, s in zip(channels, channels[1:], cfg.backbone_kernels, cfg.backbone_strides, strict=False):
            norm = nn.BatchNorm2d(c_out) if cfg.backbone_norm == "batch" else nn.InstanceNorm2d(c_out, affine=True)
            act = nn.ReLU(inplace=True) if cfg.backbone_activation == "relu" else nn.LeakyReLU(0.3, inplace=True)
            layers += [nn.Conv2d(c_in, c_out, k, stride=s), norm, act]
        self.backbone = nn.Sequential(*layers)
        c = cfg.backbone_channels[-1]  # depthwise: one feature_size × feature_size filter per channel
        self.primary = nn.Conv2d(c, c, cfg.feature_size, groups=c)
        self.class_caps = SelfAttentionRouter(
            cfg.n_primary, cfg.n_classes, cfg.primary_dim, cfg.class_dim, weight_std=cfg.router_init_std
        )
        image_shape = (cfg.in_channels, cfg.image_size, cfg.image_size)
        self.decoder = (
            CapsuleDecoder(n_capsules=cfg.n_classes, capsule_dim=cfg.class_dim, hidden=cfg.decoder_hidden,
                           out_shape=image_shape)
            if cfg.decoder
            else None
        )  # fmt: skip
        self.margin_loss = MarginLoss(cfg.n_classes)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]; returns the fields of :class:`capsnet.CapsNetOutput`, `coupling` being
        the self-attention coupling c [B, 16, 10] when asked for."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="EfficientCapsNet")
        x = self.primary(self.backbone(images))  # [B, 128, 1, 1]
        u = efficient_squash(x.view(x.shape[0], cfg.n_primary, cfg.primary_dim))  # primary capsules  [B, 16, 8]
        routed = self.class_caps(u, return_weights=True)
        v = routed.capsules  # class capsules  [B, 10, 16]
        lengths = capsule_lengths(v)
        predictions = lengths.argmax(dim=1)
        recon = None
        if self.decoder is not None and not (self.training and cfg.recon_weight == 0):
            use_labels = labels is not None and self.training and cfg.decoder_mask == "label"
            recon = self.decoder(v, labels if use_labels else predictions)
        return CapsNetOutput(v, lengths, predictions, recon, routed.weights if return_coupling else None)

    loss = CapsNet.loss  # margin loss + recon_weight × reconstruction error (recon_reduction), as CapsNet's
