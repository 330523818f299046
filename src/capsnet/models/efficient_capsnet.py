"""Efficient-CapsNet (Mazzia, Salvetti & Chiaberge, Sci. Rep. 11, 14634, 2021): 161,824 parameters on MNIST.

The network is the authors' released one (EscVM/Efficient-CapsNet: models/efficient_capsnet_graph_*.py,
utils/layers.py; the differences from the paper and their verdicts are in docs/fidelity.md):

- four unpadded convolutions, each applied as convolution → activation → normalisation, the authors' order
  (`Conv2D(activation="relu")` then `BatchNormalization()` on MNIST; conv → LeakyReLU(0.3) → InstanceNormalization
  on smallNORB), with Keras's normalisation ε = 1e-3 and BatchNorm momentum 0.99 (PyTorch's 0.01);
  `backbone_order="conv-norm-act"` is the other order;
- a depthwise convolution whose kernel covers the remaining map; its 128 outputs are 16 primary capsules of 8
  (capsule n = channels 8n … 8n+7), squashed with the paper's v = (1 − e^{−|s|}) s / |s|;
- 10 class capsules of 16 from self-attention routing (capsnet.routing.self_attention);
- class-capsule lengths √(Σ v² + 1e-7) (Keras's `Length` layer adds its backend ε inside the root);
- a reconstruction network from the masked class capsules: fully connected (MNIST) or the authors' smallNORB
  convolutional Generator (`decoder_type="conv"`, capsnet.nn.ConvCapsuleDecoder).

Initialisation follows the authors' Keras code (`init_style="keras"`): He-normal backbone kernels and capsule W
(truncated, Keras's fans), Glorot-uniform depthwise and Generator kernels, zero biases and prior, BatchNorm γ = 1,
β = 0, InstanceNorm γ, β uniform in ±0.05; `init_style="pytorch"` keeps PyTorch's layer defaults.

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

Presets: `EfficientCapsNetConfig()` (MNIST), `EfficientCapsNetConfig.for_smallnorb`,
`EfficientCapsNetConfig.for_multimnist`. Training recipe (the authors' config.json): Adam, lr 5e-4 decayed
by 0.97 every epoch, batch 16, margin loss + 0.392 × the mean squared reconstruction error. Each data set's input
pipeline, when `--augment auto`, is the authors' (`data_recipes`): MNIST-format sets ÷ 256 with the 2 px shifts;
smallNORB standardised per channel with the split's statistics, resized 96 → 64, random 48×48 crops with
brightness ±2 and contrast 0.5–1.5 for training, centre crops at test. From the command line (the data set fills
in 2 channels, 48×48, 5 classes):

    capsnet train --model efficient-capsnet --dataset SMALLNORB_DIR --backbone-kernels 7 3 3 3 \
        --backbone-strides 2 1 1 2 --backbone-norm instance --backbone-activation leaky-relu --decoder-type conv
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..configs.efficient_capsnet import EfficientCapsNetConfig
from ..errors import ConfigError
from ..nn.decoder import CapsuleDecoder, ConvCapsuleDecoder
from ..nn.keras_init import conv_keras_shape, keras_init_
from ..nn.losses import MarginLoss, capsule_lengths, margin_plus_reconstruction
from ..nn.primary import conv_output_size
from ..nn.squash import efficient_squash
from ..nn.standardize import per_image_standardize
from ..routing.self_attention import SelfAttentionRouter
from .capsnet import CapsNetOutput
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model


@register_model
class EfficientCapsNet(Pretrained, nn.Module):
    """Efficient-CapsNet; `EfficientCapsNet()` builds the authors' MNIST model (161,824 parameters without the
    decoder). Options are keyword-only and mirror `EfficientCapsNetConfig`, or pass `config=`."""

    config_class = EfficientCapsNetConfig
    model_type = "efficient-capsnet"
    paper = "Mazzia, Salvetti & Chiaberge, Sci. Rep. 2021"
    designed_for = "MNIST 28x28 (presets: EfficientCapsNetConfig.for_smallnorb, .for_multimnist)"
    routing_method = "self-attention"  # what `capsnet visualize` names the routing figure after
    default_lr = 5e-4  # the authors' Adam learning rate
    default_lr_decay = 0.97  # the authors' exponential decay per epoch
    # config.json files written before these keys existed hold models built and trained this way.
    saved_defaults: ClassVar[dict[str, Any]] = {
        "backbone_order": "conv-norm-act",
        "norm_eps": 1e-5,
        "norm_momentum": 0.1,
        "init_style": "pytorch",
        "length_eps": 0.0,
        "input_divisor": 255.0,
    }
    # The authors' input pipelines (utils/pre_process_*.py), by data format, used by `--augment auto`: TrainConfig
    # values (see capsnet.data.imageaug.AugmentSpec for the augmentation syntax).
    data_recipes: ClassVar[dict[str, dict[str, str]]] = {
        "idx": {"augment": "shift=2,divisor=256"},
        "smallnorb": {"augment": "crop=48,brightness=2,contrast=0.5:1.5,channel-standardize", "image_size": "64"},
    }

    def __init__(self, *, config: EfficientCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        layers: list[nn.Module] = []
        channels = (cfg.in_channels, *cfg.backbone_channels)
        for c_in, c_out, k, s in zip(channels, channels[1:], cfg.backbone_kernels, cfg.backbone_strides, strict=False):
            conv = nn.Conv2d(c_in, c_out, k, stride=s)
            norm = (
                nn.BatchNorm2d(c_out, eps=cfg.norm_eps, momentum=cfg.norm_momentum)
                if cfg.backbone_norm == "batch"
                else nn.InstanceNorm2d(c_out, eps=cfg.norm_eps, affine=True)
            )
            act = nn.ReLU(inplace=True) if cfg.backbone_activation == "relu" else nn.LeakyReLU(0.3, inplace=True)
            layers += [conv, act, norm] if cfg.backbone_order == "conv-act-norm" else [conv, norm, act]
        self.backbone = nn.Sequential(*layers)
        c = cfg.backbone_channels[-1]  # depthwise: one filter per channel, covering the map (→ 1×1)
        kernel = cfg.primary_kernel if cfg.primary_kernel is not None else cfg.feature_size
        # (checked here rather than in the config: the data set sets image_size after the flags)
        if kernel < 1 or conv_output_size(cfg.feature_size, kernel, cfg.primary_stride) != 1:
            raise ConfigError(
                f"the primary convolution (kernel {kernel}, stride {cfg.primary_stride}) must turn the "
                f"{cfg.feature_size}×{cfg.feature_size} feature map into 1×1"
            )
        self.primary = nn.Conv2d(c, c, kernel, stride=cfg.primary_stride, groups=c)
        self.class_caps = SelfAttentionRouter(
            cfg.n_primary, cfg.n_classes, cfg.primary_dim, cfg.class_dim, weight_std=cfg.router_init_std
        )
        self.decoder = self._make_decoder(cfg)
        self.margin_loss = MarginLoss(cfg.n_classes)
        if cfg.init_style == "keras":
            self.reset_parameters_keras()

    @staticmethod
    def _make_decoder(cfg: EfficientCapsNetConfig) -> nn.Module | None:
        if not cfg.decoder:
            return None
        shape = (cfg.in_channels, cfg.image_size, cfg.image_size)
        if cfg.decoder_type == "conv":  # (checked here: the data set fills in image_size after the flags)
            if (cfg.image_size + 16) % 8 or cfg.image_size < 8:
                raise ConfigError(f"decoder_type conv reconstructs sides 8·k − 16 (48, 56, ...), not {cfg.image_size}")
            return ConvCapsuleDecoder(n_capsules=cfg.n_classes, capsule_dim=cfg.class_dim, out_shape=shape)
        return CapsuleDecoder(
            n_capsules=cfg.n_classes, capsule_dim=cfg.class_dim, hidden=cfg.decoder_hidden, out_shape=shape
        )

    @torch.no_grad()
    def reset_parameters_keras(self) -> None:
        """The authors' initialisers (capsnet.nn.keras_init; their models/efficient_capsnet_graph_*.py)."""
        for m in self.backbone:
            if isinstance(m, nn.Conv2d):  # Conv2D(kernel_initializer="he_normal"), zero bias
                keras_init_(m.weight, "he_normal", conv_keras_shape(m.weight))
                nn.init.zeros_(m.bias)  # type: ignore[arg-type]  # (built with a bias)
            elif isinstance(m, nn.InstanceNorm2d):  # tfa InstanceNormalization(γ, β "random_uniform")
                keras_init_(m.weight, "random_uniform")
                keras_init_(m.bias, "random_uniform")
        keras_init_(self.primary.weight, "glorot_uniform", conv_keras_shape(self.primary.weight))  # Keras default
        nn.init.zeros_(self.primary.bias)  # type: ignore[arg-type]
        router = self.class_caps
        if self.config.router_init_std is None:  # FCCaps W "he_normal" on its Keras shape [out, in, in_d, out_d]
            keras_init_(router.weight, "he_normal", (router.out_caps, router.in_caps, router.in_d, router.out_d))
        nn.init.zeros_(router.prior)
        if isinstance(self.decoder, CapsuleDecoder):  # Dense: he_normal (hidden), glorot_normal (output)
            linears = [m for m in self.decoder.net if isinstance(m, nn.Linear)]
            for k, m in enumerate(linears):
                keras_init_(m.weight, "he_normal" if k < len(linears) - 1 else "glorot_normal", m.weight.T.shape)
                nn.init.zeros_(m.bias)
        elif isinstance(self.decoder, ConvCapsuleDecoder):  # Keras defaults throughout: glorot_uniform, zeros
            keras_init_(self.decoder.fc.weight, "glorot_uniform", self.decoder.fc.weight.T.shape)
            nn.init.zeros_(self.decoder.fc.bias)
            for conv in (*self.decoder.convs, self.decoder.out):
                keras_init_(conv.weight, "glorot_uniform", conv_keras_shape(conv.weight))
                nn.init.zeros_(conv.bias)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] as the data pipeline prepares them (config.json records how); returns the fields of
        `capsnet.CapsNetOutput`, `coupling` being the self-attention coupling c [B, 16, 10] when asked for."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="EfficientCapsNet")
        x = self.primary(self.backbone(per_image_standardize(images) if cfg.standardize else images))  # [B, 128, 1, 1]
        u = efficient_squash(x.view(x.shape[0], cfg.n_primary, cfg.primary_dim))  # primary capsules  [B, 16, 8]
        routed = self.class_caps(u, return_weights=True)
        v = routed.capsules  # class capsules  [B, 10, 16]
        # √(Σ_z v_z² + ε)  [B, 10]; ε = 0: the plain norm, whose gradient at v = 0 stays finite
        lengths = torch.sqrt((v * v).sum(dim=-1) + cfg.length_eps) if cfg.length_eps else capsule_lengths(v)
        predictions = lengths.argmax(dim=1)
        recon = None
        if self.decoder is not None and not (self.training and cfg.recon_weight == 0):
            use_labels = labels is not None and self.training and cfg.decoder_mask == "label"
            recon = self.decoder(v, labels if use_labels else predictions)
        return CapsNetOutput(v, lengths, predictions, recon, routed.weights if return_coupling else None)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Margin loss (summed over the classes, averaged over the batch, as the authors' `marginLoss`) +
        recon_weight × the reconstruction error against the input (their `mse`: recon_reduction "mean"). Returns
        (total, parts as detached 0-d tensors)."""
        margin = self.margin_loss(out.lengths, labels)
        return margin_plus_reconstruction(
            margin, out.reconstructions, images, weight=self.config.recon_weight, reduction=self.config.recon_reduction
        )
