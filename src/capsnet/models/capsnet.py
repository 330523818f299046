"""The paper's MNIST CapsNet (§4, Fig. 1 and 2): conv → primary capsules → routed class capsules → decoder.

The class capsules (one per class; the paper's "DigitCaps" on MNIST) are `CapsNet.class_caps`, of `class_dim`
dimensions. Older saves name them `digits` / `digit_dim`; both still load, with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..nn.decoder import CapsuleDecoder
from ..nn.losses import MarginLoss, capsule_lengths, margin_plus_reconstruction
from ..nn.primary import PrimaryCapsules, conv_output_size
from ..nn.standardize import per_image_standardize
from ..routing import ROUTINGS
from ..routing.dynamic import Router, default_weight_std
from ..routing.inverted_attention import InvertedAttentionFC
from ..routing.self_attention import SelfAttentionRouter
from ..routing.self_routing import SelfRoutingFC
from .inputs import RecordedData, check_images, check_loss_options, image_hw
from .pretrained import Pretrained


@dataclass
class CapsNetConfig(RecordedData):
    """Hyper-parameters of :class:`CapsNet`; the defaults are the paper's MNIST model."""

    in_channels: int = field(default=1, metadata={"help": "input image channels"})
    image_size: int | tuple[int, ...] = field(
        default=28, metadata={"help": "input image side, or [height, width] for non-square images"}
    )
    n_classes: int = field(default=10, metadata={"help": "number of classes (class capsules), at least 2"})
    conv_channels: int = field(default=256, metadata={"help": "channels of the first 9x9 convolution"})
    kernel_size: int = field(default=9, metadata={"help": "kernel of both convolutions"})
    padding: Literal["valid", "same"] = field(
        default="valid",
        metadata={"help": "padding of both convolutions: valid (the paper's MNIST model) or same (zero padding "
                  "kernel//2; the official code's CIFAR-10 setup, github.com/Sarasra/models research/capsules)"},
    )  # fmt: skip
    conv1_stride: int = field(
        default=1,
        metadata={
            "help": "stride of the first convolution (paper: 1); 2 or more shrinks large images' "
            "primary capsule grid, and with it the routing's memory and time"
        },
    )
    primary_types: int = field(default=32, metadata={"help": "primary capsule types"})
    primary_dim: int = field(default=8, metadata={"help": "primary capsule dimension"})
    class_dim: int = field(default=16, metadata={"help": "class capsule dimension"})
    routing_iterations: int = field(default=3, metadata={"help": "routing iterations r"})
    routing: Literal["dynamic", "self-attention", "inverted-attention", "self-routing"] = field(
        default="dynamic",
        metadata={"help": "routing of the class capsules: dynamic (Sabour et al. 2017), self-attention "
                  "(Efficient-CapsNet, Mazzia et al. 2021), inverted-attention (Tsai et al. 2020) or "
                  "self-routing (Hahn et al. 2019)"},
    )  # fmt: skip
    detach_votes: bool = field(
        default=False, metadata={"help": "stop gradients through the votes in all but the last routing iteration"}
    )
    leaky_routing: bool = field(
        default=False,
        metadata={"help": "the paper's §7 'none-of-the-above' routing: an extra zero logit in the softmax over the "
                  "class capsules, its share dropped (the paper's CIFAR-10 model; dynamic routing only)"},
    )  # fmt: skip
    capsule_bias: bool = field(
        default=False,
        metadata={"help": "a learned bias per class capsule added before the squash (as the official code's "
                  "capsule layers; dynamic routing only)"},
    )  # fmt: skip
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
    # The official TensorFlow code's choices (github.com/Sarasra/models, research/capsules; docs/fidelity.md).
    init: Literal["pytorch", "official"] = field(
        default="pytorch",
        metadata={"help": "initialisation: pytorch (PyTorch's defaults, W_ij std 1/sqrt(n_primary)) or official "
                  "(the TensorFlow code's: truncated normal std 0.05 for conv1, 0.1 for the primary kernel, W_ij "
                  "and the decoder; every bias 0.1)"},
    )  # fmt: skip
    primary_routing: bool = field(
        default=False,
        metadata={"help": "the official code's one-iteration routing of the primary capsules: the convolution's "
                  "output (not its bias) times 1/primary_types (1/(primary_types+1) with leaky routing)"},
    )  # fmt: skip
    # The official code's reduction is the default: no worse on the sample (docs/benchmarks.md), and it is what
    # produced the published figures; under Adam only its ratio to the reconstruction term matters.
    margin_reduction: Literal["sum", "half-mean"] = field(
        default="half-mean",
        metadata={"help": "margin loss: half-mean (the official code's: ½ L_k averaged over the batch and the "
                  "classes, Eq. 4 / 2n, so the reconstruction term weighs 2n times more than with sum) or sum "
                  "over the classes, averaged over the batch (Eq. 4 as printed)"},
    )  # fmt: skip
    # Layouts of other implementations, for their converted weights (capsnet.models.converters).
    primary_grouping: Literal["types", "flat"] = field(
        default="types",
        metadata={"help": "primary capsules: one per type and location (paper) or flat (D consecutive values of the "
                  "flattened conv map, XifengGuo/CapsNet-Pytorch's layout)"},
    )  # fmt: skip
    coupling: Literal["outputs", "inputs"] = field(
        default="outputs",
        metadata={"help": "axis of the coupling softmax (Eq. 3): outputs (paper) or inputs (gram-ai/"
                  "capsule-networks' computation; dynamic routing only)"},
    )  # fmt: skip

    # Keys of older config.json files (capsnet 0.1.0), read by capsnet.config.from_dict with a DeprecationWarning.
    _renamed_keys: ClassVar[dict[str, str]] = {"digit_dim": "class_dim"}

    def __post_init__(self) -> None:
        ints = (
            "in_channels",
            "conv_channels",
            "kernel_size",
            "primary_types",
            "primary_dim",
            "class_dim",
            "routing_iterations",
            "conv1_stride",
        )
        for name in ints:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_classes < 2:
            raise ConfigError(f"n_classes must be >= 2, got {self.n_classes}")
        if not isinstance(self.image_size, int):
            self.image_size = tuple(self.image_size)
            if len(self.image_size) != 2:
                raise ConfigError(f"image_size must be a side or [height, width], got {list(self.image_size)}")
        if min(image_hw(self.image_size)) < 1:
            raise ConfigError(f"image_size must be >= 1, got {self.image_size}")
        self.decoder_hidden = tuple(self.decoder_hidden)
        check_loss_options(self)
        self._check_recorded(self.n_classes)
        dynamic_only = self.leaky_routing or self.capsule_bias or self.coupling != "outputs"
        if dynamic_only and self.routing != "dynamic":
            raise ConfigError("leaky_routing, capsule_bias and coupling are options of dynamic routing "
                              "(routing='dynamic')")  # fmt: skip
        if self.coupling == "inputs" and self.leaky_routing:
            raise ConfigError("leaky routing is a softmax over the outputs: it needs coupling='outputs'")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"unknown routing {self.routing!r}; known: {', '.join(ROUTINGS)}")
        if min(self.primary_hw) < 1:
            k, (h, w) = self.kernel_size, image_hw(self.image_size)
            raise ConfigError(f"images of {h}x{w} are too small for two {k}x{k} {self.padding} convolutions "
                              f"(conv1 stride {self.conv1_stride}, primary stride 2)")  # fmt: skip

    @property
    def primary_hw(self) -> tuple[int, int]:
        """(H', W') of the primary capsule grid: 28 → conv 9 → 20 → conv 9 stride 2 → 6 (valid padding)."""
        k = self.kernel_size
        pad = k // 2 if self.padding == "same" else 0
        return tuple(  # type: ignore[return-value]
            conv_output_size(conv_output_size(side, k, self.conv1_stride, pad), k, 2, pad)
            for side in image_hw(self.image_size)
        )

    @property
    def primary_grid(self) -> int:
        """Side of a square primary capsule grid (6 for MNIST); the height for a non-square one (see primary_hw)."""
        return self.primary_hw[0]

    @property
    def n_primary(self) -> int:
        h, w = self.primary_hw
        return self.primary_types * h * w


class CapsNetOutput(NamedTuple):
    capsules: torch.Tensor  # v_j, class capsules  [B, n_classes, class_dim]
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
    paper = "Sabour, Frosst & Hinton, NeurIPS 2017"
    designed_for = "MNIST 28x28 (also MultiMNIST, affNIST tests)"
    default_lr = 1e-3  # `capsnet train`'s Adam learning rate unless --lr is given (TensorFlow's Adam default)
    # config.json files written before these keys existed: the model they describe, as it was trained
    saved_defaults: ClassVar[dict[str, Any]] = {
        "capsule_bias": False, "init": "pytorch", "primary_routing": False, "margin_reduction": "sum",
        "primary_grouping": "types", "coupling": "outputs",
    }  # fmt: skip

    def __init__(self, *, config: CapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        pad = cfg.kernel_size // 2 if cfg.padding == "same" else 0
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.conv_channels, cfg.kernel_size, stride=cfg.conv1_stride,
                               padding=pad)  # fmt: skip
        # The official code's one-iteration primary routing: uniform coupling over the types (and the leak)
        vote_scale = 1.0 / (cfg.primary_types + cfg.leaky_routing) if cfg.primary_routing else 1.0
        self.primary = PrimaryCapsules(
            in_channels=cfg.conv_channels,
            n_types=cfg.primary_types,
            capsule_dim=cfg.primary_dim,
            kernel_size=cfg.kernel_size,
            stride=2,
            padding=pad,
            vote_scale=vote_scale,
            grouping=cfg.primary_grouping,
        )
        self.class_caps = class_capsule_layer(cfg)
        if cfg.routing == "inverted-attention":  # Tsai et al.'s classifier shared by the class capsules: pose -> logit
            self.class_logit = nn.Linear(cfg.class_dim, 1)
        self.decoder = (
            CapsuleDecoder(
                n_capsules=cfg.n_classes,
                capsule_dim=cfg.class_dim,
                hidden=cfg.decoder_hidden,
                out_shape=(cfg.in_channels, *image_hw(cfg.image_size)),
            )
            if cfg.decoder
            else None
        )
        if self.decoder is not None and cfg.recon_weight == 0:
            # Untrained with recon_weight 0 (the forward pass skips it in training): frozen, so that DDP does not
            # wait for gradients that never come.
            self.decoder.requires_grad_(False)
        self.margin_loss = MarginLoss(cfg.n_classes, reduction=cfg.margin_reduction)
        if cfg.init == "official":
            official_init(self)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Accept the weights of older saves (capsnet 0.1.0), whose class capsules were called `digits`."""
        old = [k for k in state_dict if k.startswith(prefix + "digits.")]
        if old:
            warnings.warn(
                "state dict keys 'digits.*' are deprecated, now 'class_caps.*'", DeprecationWarning, stacklevel=4
            )
            for key in old:
                state_dict[prefix + "class_caps." + key[len(prefix + "digits.") :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images [B, C, H, W] in [0, 1]. In training mode, `labels` pick the capsule the decoder
        reconstructs (the paper); otherwise (or with decoder_mask="prediction") the longest capsule does."""
        check_images(images, channels=self.config.in_channels, size=self.config.image_size, model="CapsNet")
        x = per_image_standardize(images) if self.config.standardize else images
        u = self.primary(F.relu(self.conv1(x)))  # primary capsules u_i  [B, 1152, 8]
        routed = self.class_caps(u, *routing_inputs(self.config, u), return_weights=True)
        v, c = routed.capsules, routed.weights  # class capsules v_j  [B, 10, 16], weights c_ij  [B, 1152, 10]
        lengths = self._class_probabilities(routed)  # |v_j| for dynamic routing  [B, 10]
        predictions = lengths.argmax(dim=1)
        recon = None
        # In training with recon_weight 0 the reconstruction is unused: skip the decoder (its parameters would get
        # no gradient, which DistributedDataParallel rejects).
        if self.decoder is not None and not (self.training and self.config.recon_weight == 0):
            use_labels = labels is not None and self.training and self.config.decoder_mask == "label"
            recon = self.decoder(v, labels if use_labels else predictions)
        return CapsNetOutput(v, lengths, predictions, recon, c if return_coupling else None)

    def _class_probabilities(self, routed) -> torch.Tensor:
        """Each class capsule's probability in [0, 1], as the margin loss needs it: the length of a squashed
        capsule (dynamic, self-attention), the parent activation (self-routing), or, for inverted attention, whose
        LayerNorm'd poses all have about the same length, a sigmoid of Tsai et al.'s shared linear classifier."""
        if self.config.routing == "self-routing":
            return routed.activations
        if self.config.routing == "inverted-attention":
            return torch.sigmoid(self.class_logit(routed.capsules).squeeze(-1))
        return capsule_lengths(routed.capsules)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Margin loss (Eq. 4, reduced as `margin_reduction` says) + recon_weight × reconstruction error. Returns
        (total, parts as detached 0-d tensors on the loss's device: reading them is left to the caller, so a
        training step never waits)."""
        margin = self.margin_loss(out.lengths, labels)
        return margin_plus_reconstruction(margin, out.reconstructions, images, weight=self.config.recon_weight,
                                          reduction=self.config.recon_reduction)  # fmt: skip


def class_capsule_layer(cfg: CapsNetConfig) -> nn.Module:
    """The routing layer from the primary to the class capsules that `cfg.routing` names."""
    sizes = (cfg.n_primary, cfg.n_classes, cfg.primary_dim, cfg.class_dim)
    std = default_weight_std(cfg.n_primary) if cfg.router_init_std is None else cfg.router_init_std
    if cfg.routing == "self-attention":  # the fan-in rule of Router: s_j sums 1152 votes (Efficient-CapsNet: 16)
        return SelfAttentionRouter(*sizes, weight_std=std)
    if cfg.routing == "inverted-attention":
        return InvertedAttentionFC(*sizes, cfg.routing_iterations)
    if cfg.routing == "self-routing":
        return SelfRoutingFC(*sizes)
    official = cfg.router_init_std is None and cfg.init == "official"  # official_init draws W_ij at OFFICIAL_STD
    return Router(*sizes, cfg.routing_iterations, detach_votes=cfg.detach_votes,
                  weight_std=OFFICIAL_STD if official else cfg.router_init_std,
                  leaky=cfg.leaky_routing, bias=cfg.capsule_bias, coupling=cfg.coupling)  # fmt: skip


OFFICIAL_STD = 0.1  # the official code's `weight_variable` std (conv1: 0.05)


@torch.no_grad()
def official_init(model: CapsNet) -> None:
    """The official TensorFlow code's initialisation: `tf.truncated_normal_initializer` (cut at 2 std) with std 0.05
    for conv1 and 0.1 for the primary kernel, the decoder and (dynamic routing, unless router_init_std is given)
    W_ij; `tf.constant_initializer(0.1)` for every bias."""

    def truncated(w: torch.Tensor, std: float) -> None:
        nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)

    dense = [m for m in model.decoder.net if isinstance(m, nn.Linear)] if model.decoder is not None else []
    layers: list[nn.Module] = [model.conv1, model.primary.conv, *dense]
    for m, std in zip(layers, [0.05] + [OFFICIAL_STD] * (len(layers) - 1), strict=True):
        truncated(cast(torch.Tensor, m.weight), std)
        nn.init.constant_(cast(torch.Tensor, m.bias), 0.1)
    router = model.class_caps
    if isinstance(router, Router):
        truncated(router.weight, router.weight_std)
        if router.bias is not None:
            nn.init.constant_(router.bias, 0.1)


def routing_inputs(cfg: CapsNetConfig, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Input activations for the routing layer: self-routing weighs each primary capsule by its length |u_i|
    (the squashed capsule's probability of presence); the other methods take none."""
    return (capsule_lengths(u),) if cfg.routing == "self-routing" else ()
