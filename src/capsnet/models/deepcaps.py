"""DeepCaps (Rajasegaran, Jayasundara, Jayasekara, Jayasekara, Seneviratne & Rodrigo, "DeepCaps: Going Deeper with
Capsule Networks", CVPR 2019), the 28×28 network of the authors' code (github.com/brjathu/deepcaps, `DeepCapsNet28`;
the differences and their verdicts are in docs/fidelity.md):

    conv        3×3, 128 channels, "same", ReLU, BatchNorm; each channel a 1-D capsule      [B, 128, 1, 28, 28]
    cell c      x = ConvCaps2D(stride 2)(x); skip = L(x); x = ConvCaps2D(ConvCaps2D(x)) + skip, with
                L = ConvCaps2D in cells 1-3 and ConvCaps3D (3D dynamic routing, r = 3) in the last cell;
                32 types of 4, 8, 8, 8 dimensions; grids 28 → 14 → 7 → 4 → 2
    class caps  the capsules of the last two cells, flattened (position-major, type-minor) and concatenated,
                2·2·32 + 4·4·32 = 640 of 8 dimensions, dynamic routing (r = 3, with a bias) to 10 capsules of 32
    decoder     class-independent: the one 32-D capsule of the true class (in training; the longest at test) →
                Dense 7·7·16, ReLU → BatchNorm → transposed 3×3 convolutions 64 (stride 1), 32 (2), 16 (2),
                1 (1) → ReLU

Loss: the margin loss (m⁺ 0.9, m⁻ 0.1, λ 0.5, summed over the classes) + 0.4 × the mean squared reconstruction
error. Parameters, 28×28×1 and 10 classes: conv 1,280 + BN 256; cell 1: 4 · 9·128·128 = 589,824; cell 2:
9·128·256 + 3 · 9·256·256 = 2,064,384; cell 3: 4 · 589,824 = 2,359,296; cell 4: 3 · 589,824 + ConvCaps3D
(8·9·256 + 256 = 18,688) = 1,788,160; class capsules 640·10·8·32 + 10·32 = 1,638,720: 8,441,920 without the
decoder; the decoder 25,872 + 32 + 9,280 + 18,464 + 4,624 + 145 = 58,417; 8,500,337 in all.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.deepcaps import DeepCapsConfig
from ..errors import ConfigError
from ..nn.losses import MarginLoss, capsule_lengths, margin_plus_reconstruction
from ..nn.standardize import per_image_standardize
from ..routing.deepcaps import ConvCaps2D, ConvCaps3D, glorot_uniform_
from ..routing.dynamic import Router, coherent_vote_lr
from .capsnet import CapsNetOutput
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model

KERAS_BN_EPS = 1e-3  # Keras BatchNormalization's ε


def _stride(layer: nn.Module) -> int:
    stride = getattr(layer, "stride", (1,))
    return int(stride[0])


class DeepCapsDecoder(nn.Module):
    """The class-independent decoder: one capsule [B, D] → Dense s·s·16 + ReLU → BatchNorm → transposed 3×3
    convolutions ("same": stride 1, then stride 2 for each further entry) → one to the image's channels → ReLU."""

    def __init__(self, capsule_dim: int, channels: tuple[int, ...], out_channels: int, image_size: int):
        super().__init__()
        self.side = image_size // 2 ** (len(channels) - 1)
        self.fc = nn.Linear(capsule_dim, self.side * self.side * 16)
        self.norm = nn.BatchNorm2d(16, eps=KERAS_BN_EPS, momentum=0.2)  # Keras momentum 0.8
        widths = (16, *channels, out_channels)
        strides = (1, *[2] * (len(channels) - 1), 1)
        self.deconvs = nn.ModuleList(
            nn.ConvTranspose2d(a, b, 3, stride=s) for a, b, s in zip(widths, widths[1:], strides)
        )

    def forward(self, capsules: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """capsules [B, n_classes, D], classes [B] -> images [B, C, H, W]: only the capsule of `classes` is read."""
        capsule = capsules[torch.arange(capsules.shape[0], device=capsules.device), classes.long()]  # [B, D]
        x = F.relu(self.fc(capsule))  # Keras Reshape((s, s, 16)) of the Dense output: channels last
        x = self.norm(x.view(-1, self.side, self.side, 16).permute(0, 3, 1, 2))
        for deconv in self.deconvs:
            n = x.shape[-1]
            # unpadded: side (n − 1)·s + 3. TF's "same" keeps n·s of it: the transpose of a convolution padded
            # (1, 1) at stride 1 (crop one each side), (0, 1) at stride 2 (crop the last row and column)
            start, side = (1, n) if _stride(deconv) == 1 else (0, 2 * n)
            x = deconv(x)[..., start : start + side, start : start + side]
        return F.relu(x)


AUTHORS_CLASS_LAYER = (640, 10)  # their 28×28 class layer: the last two cells' 2·2·32 + 4·4·32 capsules, 10 classes


@register_model
class DeepCaps(Pretrained, nn.Module):
    """DeepCaps; `DeepCaps()` builds the authors' 28×28 network (8,441,920 parameters without the decoder,
    8,500,337 with it). Options are keyword-only and mirror `DeepCapsConfig`, or pass `config=`."""

    config_class = DeepCapsConfig
    model_type = "deepcaps"
    paper = "Rajasegaran et al., CVPR 2019 (DeepCaps)"
    designed_for = "Fashion-MNIST / MNIST 28x28 (also CIFAR-10, SVHN at 64x64)"
    routing_method = "dynamic"  # the class capsules' routing, drawn by `capsnet visualize`
    default_lr = 1e-3  # the authors' Adam learning rate
    default_lr_decay = 0.5**0.1  # their ×0.5 every 10 epochs, spread evenly over the epochs
    default_batch_size = 256  # their batch size
    # their Keras ImageDataGenerator on MNIST-format sets: shifts of 10%, rotation 0.1°, zoom 0.9-1.1; their horizontal
    # flips are left out (capsnet refuses them on digit sets; `--augment ...,flip` adds them on Fashion-MNIST)
    data_recipes: ClassVar[dict[str, dict[str, str]]] = {"idx": {"augment": "shift=3,rotate=0.1,zoom=0.9:1.1"}}
    saved_defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def lr_for(cls, config: DeepCapsConfig) -> float:
        """The authors' 1e-3 for their 28×28 class layer (640 capsules to 10 classes) and below; lower where its
        dynamic routing sums more votes per class (capsnet.routing.dynamic.coherent_vote_lr)."""
        return coherent_vote_lr(
            cls.default_lr, in_caps=config.n_class_inputs, out_caps=config.n_classes, reference=AUTHORS_CLASS_LAYER
        )

    def __init__(self, *, config: DeepCapsConfig | None = None, **options: Any):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        self.conv = nn.Conv2d(cfg.in_channels, cfg.conv_channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(cfg.conv_channels, eps=KERAS_BN_EPS, momentum=0.01)  # Keras momentum 0.99
        self.cells = nn.ModuleList()
        t_in, d_in = cfg.conv_channels, 1
        for c, (t, d) in enumerate(zip(cfg.cell_types, cfg.cell_dims, strict=True)):
            last = c == len(cfg.cell_types) - 1
            skip = (
                ConvCaps3D(t, d, t, d, iterations=cfg.routing_iterations, input_layout=cfg.conv3d_input)
                if last
                else ConvCaps2D(t, d, t, d)
            )
            cell = nn.ModuleDict(
                {
                    "down": ConvCaps2D(t_in, d_in, t, d, stride=2),
                    "skip": skip,
                    "a": ConvCaps2D(t, d, t, d),
                    "b": ConvCaps2D(t, d, t, d),
                }
            )
            self.cells.append(cell)
            t_in, d_in = t, d
        if cfg.cell_dims[-1] != cfg.cell_dims[-2]:
            raise ConfigError("the last two cells' capsules are concatenated: their cell_dims must be equal")
        n_in, d = cfg.n_class_inputs, cfg.cell_dims[-1]
        self.class_caps = Router(n_in, cfg.n_classes, d, cfg.class_dim, cfg.routing_iterations, bias=True)
        with torch.no_grad():  # Keras glorot_uniform on their W [n, in, class_dim, d] and B [n, class_dim]
            glorot_uniform_(self.class_caps.weight, cfg.class_dim * cfg.n_classes * n_in, d * cfg.n_classes * n_in)
            glorot_uniform_(self.class_caps.bias, cfg.n_classes, cfg.class_dim)  # type: ignore[arg-type]
        self.decoder = (
            DeepCapsDecoder(cfg.class_dim, cfg.decoder_channels, cfg.in_channels, cfg.image_size)
            if cfg.decoder
            else None
        )
        self.margin_loss = MarginLoss(cfg.n_classes)

    @staticmethod
    def _flat(x: torch.Tensor) -> torch.Tensor:
        """A grid [B, T, D, H, W] as capsules [B, H·W·T, D] (position-major, as the authors' FlattenCaps)."""
        return x.permute(0, 3, 4, 1, 2).reshape(x.shape[0], -1, x.shape[2])

    def encode(self, images: torch.Tensor) -> list[torch.Tensor]:
        """The output grid of each cell, [B, T, D, H, W]."""
        x = self.norm(F.relu(self.conv(images))).unsqueeze(2)  # 1-D capsules  [B, 128, 1, H, W]
        outs = []
        for cell in self.cells:
            assert isinstance(cell, nn.ModuleDict)
            x = cell["down"](x)
            x = cell["b"](cell["a"](x)) + cell["skip"](x)
            outs.append(x)
        return outs

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]; the fields of `capsnet.CapsNetOutput`, `coupling` the class
        routing's c [B, 640, n_classes] when asked for."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="DeepCaps")
        outs = self.encode(per_image_standardize(images) if cfg.standardize else images)
        u = torch.cat([self._flat(outs[-1]), self._flat(outs[-2])], dim=1)  # [B, 640, 8]
        routed = self.class_caps(u, return_weights=True)
        v = routed.capsules  # [B, n_classes, class_dim]
        lengths = capsule_lengths(v)
        predictions = lengths.argmax(dim=1)
        recon = None
        if self.decoder is not None and not (self.training and cfg.recon_weight == 0):
            chosen = labels if labels is not None and self.training else predictions
            recon = self.decoder(v, chosen)
        return CapsNetOutput(v, lengths, predictions, recon, routed.weights if return_coupling else None)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The margin loss (summed over the classes, averaged over the batch) + recon_weight × the mean squared
        reconstruction error (Keras "mse"), as the authors' train.py. Returns (total, detached parts)."""
        margin = self.margin_loss(out.lengths, labels)
        return margin_plus_reconstruction(
            margin, out.reconstructions, images, weight=self.config.recon_weight, reduction="mean"
        )
