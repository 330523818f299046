"""The paper's MNIST CapsNet (§4, Fig. 1 and 2): conv → primary capsules → routed digit capsules → decoder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..nn.decoder import CapsuleDecoder
from ..nn.losses import MarginLoss, capsule_lengths, reconstruction_loss
from ..nn.primary import PrimaryCapsules
from ..routing.dynamic import Router
from .pretrained import Pretrained


@dataclass
class CapsNetConfig:
    """Hyper-parameters of :class:`CapsNet`; the defaults are the paper's MNIST model."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int = field(default=28, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (digit capsules)"})
    conv_channels: int = field(default=256, metadata={"help": "channels of the first 9x9 convolution"})
    kernel_size: int = field(default=9, metadata={"help": "kernel of both convolutions"})
    primary_types: int = field(default=32, metadata={"help": "primary capsule types"})
    primary_dim: int = field(default=8, metadata={"help": "primary capsule dimension"})
    digit_dim: int = field(default=16, metadata={"help": "digit capsule dimension"})
    routing_iterations: int = field(default=3, metadata={"help": "routing iterations r"})
    detach_votes: bool = field(
        default=False, metadata={"help": "stop gradients through the votes in all but the last routing iteration"}
    )
    decoder: bool = field(default=True, metadata={"help": "add the reconstruction decoder"})
    decoder_hidden: tuple[int, ...] = field(default=(512, 1024), metadata={"help": "decoder hidden sizes"})
    decoder_mask: Literal["label", "prediction"] = field(
        default="label",
        metadata={"help": "capsule the decoder reconstructs in training: the true label (paper) or the prediction"},
    )
    recon_weight: float = field(default=0.0005, metadata={"help": "weight of the summed squared reconstruction error"})
    recon_reduction: Literal["sum", "mean"] = field(
        default="sum", metadata={"help": "per-image reduction of squared errors: sum (paper) or mean"}
    )
    router_init_std: float | None = field(
        default=None, metadata={"help": "initial std of W_ij (default: capsnet.routing.default_weight_std)"}
    )

    def __post_init__(self) -> None:
        ints = ("in_channels", "image_size", "n_classes", "conv_channels", "kernel_size", "primary_types",
                "primary_dim", "digit_dim", "routing_iterations")
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.decoder_hidden = tuple(self.decoder_hidden)
        if self.primary_grid < 1:
            k = self.kernel_size
            raise ConfigError(f"image_size {self.image_size} is too small for two {k}x{k} convolutions")

    @property
    def primary_grid(self) -> int:
        """Side of the primary capsule grid: 28 → conv 9 → 20 → conv 9 stride 2 → 6."""
        return (self.image_size - 2 * (self.kernel_size - 1) - 1) // 2 + 1

    @property
    def n_primary(self) -> int:
        return self.primary_types * self.primary_grid**2


class CapsNetOutput(NamedTuple):
    capsules: torch.Tensor  # v_j, digit capsules  [B, n_classes, digit_dim]
    lengths: torch.Tensor  # |v_j|, class probabilities  [B, n_classes]
    predictions: torch.Tensor  # argmax_j |v_j|  [B]
    reconstructions: torch.Tensor | None  # decoder output  [B, C, H, W], None without decoder
    coupling: torch.Tensor | None  # final c_ij [B, n_primary, n_classes] when asked for


class CapsNet(Pretrained, nn.Module):
    """The paper's CapsNet: 8,215,568 parameters with the decoder, 6,804,224 without, on 28×28 MNIST.

    `CapsNet()` builds the paper's model; options are keyword-only and mirror :class:`CapsNetConfig`,
    e.g. `CapsNet(routing_iterations=1, decoder=False)`, or pass `config=CapsNetConfig(...)`.
    """

    config_class = CapsNetConfig
    model_type = "capsnet"
    default_lr = 1e-3  # `capsnet train`'s Adam learning rate unless --lr is given (TensorFlow's Adam default)

    def __init__(self, *, config: CapsNetConfig | None = None, **options):
        super().__init__()
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        self.config = cfg = config if config is not None else CapsNetConfig(**options)
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.conv_channels, cfg.kernel_size)
        self.primary = PrimaryCapsules(
            in_channels=cfg.conv_channels, n_types=cfg.primary_types, capsule_dim=cfg.primary_dim,
            kernel_size=cfg.kernel_size, stride=2,
        )
        self.digits = Router(
            cfg.n_primary, cfg.n_classes, cfg.primary_dim, cfg.digit_dim, cfg.routing_iterations,
            detach_votes=cfg.detach_votes, weight_std=cfg.router_init_std,
        )
        self.decoder = (
            CapsuleDecoder(
                n_capsules=cfg.n_classes, capsule_dim=cfg.digit_dim, hidden=cfg.decoder_hidden,
                out_shape=(cfg.in_channels, cfg.image_size, cfg.image_size),
            )
            if cfg.decoder
            else None
        )
        self.margin_loss = MarginLoss(cfg.n_classes)

    def _check_images(self, x: torch.Tensor) -> None:
        c, s = self.config.in_channels, self.config.image_size
        if x.dim() != 4 or tuple(x.shape[1:]) != (c, s, s):
            raise ValueError(f"CapsNet expects images of shape [B, {c}, {s}, {s}], got {list(x.shape)}")

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]. In training mode, `labels` pick the capsule the decoder
        reconstructs (the paper); otherwise (or with decoder_mask="prediction") the longest capsule does."""
        self._check_images(images)
        u = self.primary(F.relu(self.conv1(images)))  # primary capsules u_i  [B, 1152, 8]
        v, c = self.digits(u, return_coupling=True)  # digit capsules v_j  [B, 10, 16]
        lengths = capsule_lengths(v)  # |v_j|  [B, 10]
        predictions = lengths.argmax(dim=1)
        recon = None
        if self.decoder is not None:
            use_labels = labels is not None and self.training and self.config.decoder_mask == "label"
            recon = self.decoder(v, labels if use_labels else predictions)
        return CapsNetOutput(v, lengths, predictions, recon, c if return_coupling else None)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Margin loss (Eq. 4) + recon_weight × reconstruction error. Returns (total, parts as floats)."""
        margin = self.margin_loss(out.lengths, labels)
        total, parts = margin, {"margin": margin.item()}
        if out.reconstructions is not None and self.config.recon_weight > 0:
            recon = reconstruction_loss(
                out.reconstructions, images, weight=self.config.recon_weight, reduction=self.config.recon_reduction
            )
            total = total + recon
            parts["reconstruction"] = recon.item()
        parts["total"] = total.item()
        return total, parts
