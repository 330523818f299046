"""The config of the efficient-capsnet model: its fields, paper defaults and checks.

Torch-free, so that `capsnet train --help` builds its flags without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from .base import (
    RecordedData,
    check_loss_options,
    conv_output_size,
    register_config,
)


@dataclass
class EfficientCapsNetConfig(RecordedData):
    """Hyper-parameters of `EfficientCapsNet`; the defaults are the authors' MNIST model."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int = field(default=28, metadata={"help": "input image height and width"})
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules)"})
    backbone_channels: tuple[int, ...] = field(
        default=(32, 64, 64, 128), metadata={"help": "channels of the backbone convolutions"}
    )
    backbone_kernels: tuple[int, ...] = field(default=(5, 3, 3, 3), metadata={"help": "their kernel sizes"})
    backbone_strides: tuple[int, ...] = field(default=(1, 1, 1, 2), metadata={"help": "their strides"})
    backbone_norm: Literal["batch", "instance"] = field(
        default="batch", metadata={"help": "normalisation of each backbone block"}
    )
    backbone_activation: Literal["relu", "leaky-relu"] = field(
        default="relu", metadata={"help": "activation of each backbone block (leaky ReLU: Keras's slope 0.3)"}
    )
    backbone_order: Literal["conv-act-norm", "conv-norm-act"] = field(
        default="conv-act-norm",
        metadata={"help": "order in each backbone block: conv-act-norm (the authors' code) or conv-norm-act"},
    )
    norm_eps: float = field(default=1e-3, metadata={"help": "epsilon of the backbone normalisations (Keras: 1e-3)"})
    norm_momentum: float = field(
        default=0.01, metadata={"help": "BatchNorm running-average momentum, PyTorch's convention (Keras 0.99 = 0.01)"}
    )
    init_style: Literal["keras", "pytorch"] = field(
        default="keras", metadata={"help": "init: keras (the authors' initialisers) or pytorch (the layers' defaults)"}
    )
    primary_kernel: int | None = field(
        default=None, metadata={"help": "depthwise primary convolution kernel (None: the last feature map's side)"}
    )
    primary_stride: int = field(default=1, metadata={"help": "depthwise primary convolution stride"})
    primary_dim: int = field(default=8, metadata={"help": "primary capsule dimension"})
    class_dim: int = field(default=16, metadata={"help": "class capsule dimension"})
    length_eps: float = field(
        default=1e-7, metadata={"help": "class-capsule length sqrt(|v|^2 + eps) (the authors' Keras Length: 1e-7)"}
    )
    decoder: bool = field(default=True, metadata={"help": "add the reconstruction decoder"})
    decoder_type: Literal["fc", "conv"] = field(
        default="fc", metadata={"help": "decoder: fc (MNIST) or conv (the authors' smallNORB Generator)"}
    )
    decoder_hidden: tuple[int, ...] = field(default=(512, 1024), metadata={"help": "decoder hidden sizes"})
    decoder_mask: Literal["label", "prediction"] = field(
        default="label", metadata={"help": "capsule the decoder reconstructs in training: true label or prediction"}
    )
    recon_weight: float = field(default=0.392, metadata={"help": "weight of the reconstruction error"})
    recon_reduction: Literal["sum", "mean"] = field(
        default="mean", metadata={"help": "per-image reduction of squared errors"}
    )
    router_init_std: float | None = field(
        default=None, metadata={"help": "initial std of W_ij, a plain normal (default: as init_style)"}
    )
    # The authors' MNIST pre-processing divides by 256 (utils/pre_process_mnist.py); recorded for evaluate/predict.
    input_divisor: float = field(
        default=256.0, kw_only=True, metadata={"help": "uint8 pixels are divided by this; set from the augmentation"}
    )

    def __post_init__(self) -> None:
        for name in ("backbone_channels", "backbone_kernels", "backbone_strides", "decoder_hidden"):
            setattr(self, name, tuple(getattr(self, name)))
        for name in ("in_channels", "image_size", "n_classes", "primary_dim", "class_dim", "primary_stride"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_loss_options(self)
        layers = (self.backbone_channels, self.backbone_kernels, self.backbone_strides)
        if not self.backbone_channels or len(set(map(len, layers))) != 1 or min(min(x) for x in layers) < 1:
            raise ConfigError(
                "backbone_channels, backbone_kernels and backbone_strides need one positive value "
                "per convolution, as many of each"
            )
        if self.backbone_channels[-1] % self.primary_dim:
            raise ConfigError(
                f"the last backbone channels ({self.backbone_channels[-1]}) must be a multiple of "
                f"primary_dim ({self.primary_dim})"
            )
        if not (self.norm_eps > 0 and 0 <= self.norm_momentum <= 1 and self.length_eps >= 0):
            raise ConfigError("need norm_eps > 0, 0 <= norm_momentum <= 1 and length_eps >= 0")
        if self.feature_size < 1:
            raise ConfigError(f"image_size {self.image_size} is too small for the backbone convolutions")
        self._check_recorded(self.n_classes)

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
        """The authors' smallNORB model: 48×48 stereo pairs (2 channels), 5 classes, a 7×7 stride-2 first
        convolution, leaky ReLU then instance normalisation, feature maps 48 → 21 → 19 → 17 → 8 → 1, and the
        convolutional Generator (151,664 + 229,570 parameters)."""
        preset = dict(
            in_channels=2,
            image_size=48,
            n_classes=5,
            backbone_kernels=(7, 3, 3, 3),
            backbone_strides=(2, 1, 1, 2),
            backbone_norm="instance",
            backbone_activation="leaky-relu",
            decoder_type="conv",
            input_divisor=255.0,  # (their smallNORB input is standardized per channel: see data_recipes)
        )
        return cls(**{**preset, **overrides})

    @classmethod
    def for_multimnist(cls, **overrides) -> EfficientCapsNetConfig:
        """The authors' MultiMNIST model (models/efficient_capsnet_graph_multimnist.py): 36×36 pairs, strides
        1, 1, 2, 2 (36 → 32 → 30 → 14 → 6), a 5×5 stride-2 depthwise primary convolution (→ 1), the fully
        connected decoder to 36×36, and each digit's reconstruction weighted 0.392 / 2 (their loss weights);
        their MultiMNIST pixels are ÷ 255 (utils/pre_process_multimnist.py)."""
        preset = dict(
            image_size=36,
            backbone_strides=(1, 1, 2, 2),
            primary_kernel=5,
            primary_stride=2,
            recon_weight=0.196,
            input_divisor=255.0,
        )
        return cls(**{**preset, **overrides})


register_config("efficient-capsnet", EfficientCapsNetConfig)
