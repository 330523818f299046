"""The paper's MNIST CapsNet (§4, Fig. 1 and 2): conv → primary capsules → routed class capsules → decoder.

The class capsules (one per class; the paper's "DigitCaps" on MNIST) are `CapsNet.class_caps`, of `class_dim`
dimensions. Older saves name them `digits` / `digit_dim`; both still load, with a DeprecationWarning.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.capsnet import CapsNetConfig
from ..configs.routings import RoutingRecord, routing_record
from ..nn.decoder import CapsuleDecoder
from ..nn.losses import MarginLoss, capsule_lengths, margin_plus_reconstruction
from ..nn.primary import PrimaryCapsules
from ..nn.standardize import per_image_standardize
from ..routing.base import RoutingOutput
from ..routing.dynamic import Router, coherent_vote_lr
from ..routing.registry import build_routing
from .inputs import check_images, image_hw
from .pretrained import Pretrained
from .registry import register_model


class CapsNetOutput(NamedTuple):
    capsules: torch.Tensor  # v_j, class capsules  [B, n_classes, class_dim]
    lengths: torch.Tensor  # |v_j|, class probabilities  [B, n_classes]
    predictions: torch.Tensor  # argmax_j |v_j|  [B]
    reconstructions: torch.Tensor | None  # decoder output  [B, C, H, W], None without decoder
    coupling: torch.Tensor | None  # final c_ij [B, n_primary, n_classes] when asked for


MNIST_CLASS_LAYER = (1152, 10)  # the paper's class layer: 6·6·32 primary capsules routed to 10 digit capsules


@register_model
class CapsNet(Pretrained, nn.Module):
    """The paper's CapsNet: 8,215,568 parameters with the decoder, 6,804,224 without, on 28×28 MNIST.

    `CapsNet()` builds the paper's model; options are keyword-only and mirror `CapsNetConfig`,
    e.g. `CapsNet(routing_iterations=1, decoder=False)`, or pass `config=CapsNetConfig(...)`.
    """

    config_class = CapsNetConfig
    model_type = "capsnet"
    paper = "Sabour, Frosst & Hinton, NeurIPS 2017"
    designed_for = "MNIST 28x28 (also MultiMNIST, affNIST tests)"
    default_lr = 1e-3  # `capsnet train`'s Adam learning rate unless --lr is given (TensorFlow's Adam default)
    # On data of one's own an epoch takes at least 400 steps, twice the loop's 200: at the lower rate of a layer with
    # more votes per class (lr_for) the shapes set's test accuracy rises from 85.3% (seed 0) to 93.2 ± 1.1% (seeds
    # 0-2; docs/training.md, "What learns a folder of one's own"). Recorded recipes (MNIST, ...) keep one pass an epoch.
    own_data_epoch_steps = 400
    # config.json files written before these keys existed: the model they describe, as it was trained
    saved_defaults: ClassVar[dict[str, Any]] = {
        "capsule_bias": False,
        "init": "pytorch",
        "primary_routing": False,
        "margin_reduction": "sum",
        "primary_grouping": "types",
        "coupling": "outputs",
    }

    @classmethod
    def lr_for(cls, config: CapsNetConfig) -> float:
        """The paper's 1e-3 for its MNIST layer (1,152 primary capsules to 10 classes) and below; lower where
        dynamic routing sums more votes per class (capsnet.routing.dynamic.coherent_vote_lr)."""
        if config.routing != "dynamic":
            return cls.default_lr
        return coherent_vote_lr(
            cls.default_lr, in_caps=config.n_primary, out_caps=config.n_classes, reference=MNIST_CLASS_LAYER
        )

    def __init__(self, *, config: CapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        pad = cfg.kernel_size // 2 if cfg.padding == "same" else 0
        self.conv1 = nn.Conv2d(
            cfg.in_channels, cfg.conv_channels, cfg.kernel_size, stride=cfg.conv1_stride, padding=pad
        )
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
        self.routing_record = routing_record(cfg.routing)
        self.class_caps = class_capsule_layer(cfg, self.routing_record)
        if self.routing_record.probability == "classifier":  # Tsai et al.'s, shared by the classes: pose -> logit
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

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> CapsNetOutput:
        """images: the prepared input [B, C, H, W] (capsnet.preprocess makes it from raw pixels). In training mode,
        `labels` pick the capsule the decoder reconstructs (the paper); otherwise (or with decoder_mask="prediction")
        the longest capsule does."""
        check_images(images, channels=self.config.in_channels, size=self.config.image_size, model="CapsNet")
        x = per_image_standardize(images) if self.config.standardize else images
        u = self.primary(F.relu(self.conv1(x)))  # primary capsules u_i  [B, 1152, 8]
        routed = self.class_caps(u, *routing_inputs(self.routing_record, u), return_weights=True)
        if not isinstance(routed, RoutingOutput):
            raise TypeError(
                f"routing {self.config.routing!r} returned a {type(routed).__name__} for "
                "return_weights=True, not a capsnet.routing.base.RoutingOutput"
            )
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

    def _class_probabilities(self, routed: RoutingOutput) -> torch.Tensor:
        """Each class capsule's probability in [0, 1], as the margin loss needs it, read as the routing's record
        says (capsnet.configs.routings.Probability): the length of a squashed capsule (dynamic, self-attention),
        the parent activation (self-routing, EM), or, for inverted attention, whose LayerNorm'd poses all have
        about the same length, a sigmoid of Tsai et al.'s shared linear classifier."""
        rule = self.routing_record.probability
        if rule == "activation":
            if routed.activations is None:
                raise TypeError(f"routing {self.config.routing!r} declares activations but returned none")
            return routed.activations
        if rule == "classifier":
            return torch.sigmoid(self.class_logit(routed.capsules).squeeze(-1))
        return capsule_lengths(routed.capsules)

    def loss(
        self, out: CapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Margin loss (Eq. 4, reduced as `margin_reduction` says) + recon_weight × reconstruction error. Returns
        (total, parts as detached 0-d tensors on the loss's device: reading them is left to the caller, so a
        training step never waits)."""
        margin = self.margin_loss(out.lengths, labels)
        return margin_plus_reconstruction(
            margin, out.reconstructions, images, weight=self.config.recon_weight, reduction=self.config.recon_reduction
        )


def class_capsule_layer(cfg: CapsNetConfig, record: RoutingRecord) -> nn.Module:
    """The routing layer from the primary to the class capsules that `cfg.routing` names (its `record` in the
    routing registry), with the options of cfg that the record lists."""
    options = {keyword: getattr(cfg, name) for name, keyword in record.options.items()}
    assert cfg.routing_iterations is not None  # (CapsNetConfig resolves it)
    return build_routing(
        cfg.routing,
        in_caps=cfg.n_primary,
        out_caps=cfg.n_classes,
        in_d=cfg.primary_dim,
        out_d=cfg.class_dim,
        iterations=cfg.routing_iterations,
        **options,
    )


OFFICIAL_STD = 0.1  # the official code's `weight_variable` std (conv1: 0.05)


@torch.no_grad()
def official_init(model: CapsNet) -> None:
    """The official TensorFlow code's initialisation: `tf.truncated_normal_initializer` (cut at 2 std) with std 0.05
    for conv1 and 0.1 for the primary kernel, the decoder and (dynamic routing) W_ij, unless router_init_std gives
    its std; `tf.constant_initializer(0.1)` for every bias."""

    def truncated(w: torch.Tensor, std: float) -> None:
        nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)

    dense = [m for m in model.decoder.net if isinstance(m, nn.Linear)] if model.decoder is not None else []
    layers: list[nn.Module] = [model.conv1, model.primary.conv, *dense]
    for m, std in zip(layers, [0.05] + [OFFICIAL_STD] * (len(layers) - 1), strict=True):
        truncated(cast(torch.Tensor, m.weight), std)
        nn.init.constant_(cast(torch.Tensor, m.bias), 0.1)
    router = model.class_caps
    if isinstance(router, Router):
        if model.config.router_init_std is None:
            router.weight_std = OFFICIAL_STD
        truncated(router.weight, router.weight_std)
        if router.bias is not None:
            nn.init.constant_(router.bias, 0.1)


def routing_inputs(record: RoutingRecord, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Input activations for the routing layer: a routing with activations (self-routing, EM) weighs each primary
    capsule by its length |u_i| (the squashed capsule's probability of presence); the others take none."""
    return (capsule_lengths(u),) if record.activations else ()
