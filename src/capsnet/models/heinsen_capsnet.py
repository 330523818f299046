"""Heinsen's smallNORB classifier (An Algorithm for Routing Capsules in All Domains, 2019, §4.1; the authors'
models.py `SmallNORBClassifier`): 99.1% on smallNORB, weights public.

images [B, 2, 96, 96] + a 2-channel coordinate grid → six 3×3 convolutions (BatchNorm → conv → Swish, strides
1, 2, 1, 2, 1, 2: 96 → 9) → per position and part type, an activation logit a_i (BatchNorm → 1×1 conv) and a 4×4
pose μ_i (BatchNorm → 1×1 conv) → Heinsen routing of the 64 · 9² parts to 64 parts (one W shared by every child)
→ Heinsen routing of the 64 parts to the 5 object capsules, whose scores a_j are the class logits (cross-entropy).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.heinsen_capsnet import STRIDES, HeinsenCapsNetConfig
from ..nn.losses import full_precision
from ..nn.standardize import per_image_standardize
from ..routing.heinsen import HeinsenRouting
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model

POSE = 4  # capsules are 4×4 matrices


class HeinsenCapsNetOutput(NamedTuple):
    """Mirrors `capsnet.CapsNetOutput` so that training, evaluation and prediction treat both alike."""

    capsules: torch.Tensor  # object poses μ_j, flattened 4×4  [B, n_classes, 16]
    lengths: torch.Tensor  # class probabilities f(a_j) = sigmoid(a_j)  [B, n_classes]
    predictions: torch.Tensor  # argmax_j a_j  [B]
    reconstructions: None
    coupling: torch.Tensor | None  # R_ij of the object routing  [B, n_parts, n_classes] when asked for
    logits: torch.Tensor  # a_j, the class scores ("bang per bit")  [B, n_classes]


def coordinate_grid(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, H, W] with two channels appended: the row and column coordinates, each from −1 to 1 (in float32,
    as the authors' grid, whatever x's dtype)."""
    h, w = x.shape[-2:]
    rows = torch.linspace(-1.0, 1.0, h, device=x.device)[:, None].expand(h, w)
    cols = torch.linspace(-1.0, 1.0, w, device=x.device)[None, :].expand(h, w)
    return torch.cat([x, torch.stack([rows, cols]).to(x.dtype).expand(x.shape[0], 2, h, w)], dim=1)


@register_model
class HeinsenCapsNet(Pretrained, nn.Module):
    """The authors' smallNORB model: 271,688 parameters (2 channels, 96×96, 5 classes).

    Module names follow the authors' (convolve, compute_a, compute_mu, routings), so their state dict converts by
    renaming the routings' W, B to weight, bias (capsnet.models.converters.heinsen).
    """

    config_class = HeinsenCapsNetConfig
    model_type = "heinsen-capsnet"
    paper = "Heinsen, arXiv:1911.00792, 2019 (An Algorithm for Routing Capsules in All Domains)"
    designed_for = "smallNORB 96x96 stereo pairs"
    routing_method = "heinsen"  # what `capsnet visualize` names the routing figure after
    default_lr = 5e-4  # the authors' RAdam learning rate (here Adam's)
    default_lr_decay = (1e-5 / 5e-4) ** (1 / 50)  # their one-cycle schedule ends at 1e-5 after 50 epochs
    default_batch_size = 20  # their batch size
    # their pipeline: 96×96 pairs in [0, 1], RandomCrop(96, padding=16) in training (here: shifts of up to 16 px)
    data_recipes: ClassVar[dict[str, dict[str, str]]] = {"smallnorb": {"augment": "shift=16", "image_size": "96"}}
    # On one's own data the Gaussian parent model stays at chance (docs/training.md, "What learns a folder of one's
    # own"); the authors' soft k-means one learns it, given 400 steps an epoch (at lr_for's rate).
    own_data_options: ClassVar[dict[str, Any]] = {"p_model": "skm"}
    own_data_epoch_steps = 400

    @classmethod
    def lr_for(cls, config: HeinsenCapsNetConfig) -> float:
        """The authors' rate with their Gaussian parent model; half of it with soft k-means (`p_model="skm"`, for
        which they give none): at 5e-4, one seed of three stayed at chance on the shapes set (docs/training.md)."""
        return cls.default_lr / 2 if config.p_model == "skm" else cls.default_lr

    def __init__(self, *, config: HeinsenCapsNetConfig | None = None, **options):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        c, pad = cfg.conv_channels, cfg.padding
        stem: list[nn.Module] = []
        for c_in, stride in zip([cfg.in_channels + 2] + [c] * 5, STRIDES, strict=True):
            stem += [nn.BatchNorm2d(c_in), nn.Conv2d(c_in, c, 3, stride, padding=pad), nn.SiLU()]  # SiLU: Swish
        self.convolve = nn.Sequential(*stem)
        self.compute_a = nn.Sequential(nn.BatchNorm2d(c), nn.Conv2d(c, cfg.n_parts, 1))
        self.compute_mu = nn.Sequential(nn.BatchNorm2d(c), nn.Conv2d(c, cfg.n_parts * POSE * POSE, 1))
        route = {"iterations": cfg.routing_iterations, "rows": POSE, "p_model": cfg.p_model}
        self.routings = nn.ModuleList(
            [
                HeinsenRouting(-1, cfg.n_parts, POSE * POSE, POSE * POSE, **route),  # parts: one W for every child
                HeinsenRouting(cfg.n_parts, cfg.n_classes, POSE * POSE, POSE * POSE, **route),
            ]
        )
        for conv in self.convolve:
            if isinstance(conv, nn.Conv2d):
                nn.init.kaiming_normal_(conv.weight)
                nn.init.zeros_(cast(torch.Tensor, conv.bias))

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor | None = None, *, return_coupling: bool = False
    ) -> HeinsenCapsNetOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="HeinsenCapsNet")
        x = self.convolve(coordinate_grid(per_image_standardize(images) if cfg.standardize else images))
        b, _, h, w = x.shape  # [B, channels, 9, 9]
        a = self.compute_a(x).reshape(b, -1)  # logits a_i, part-major  [B, n_parts·h·w]
        mu = self.compute_mu(x).view(b, cfg.n_parts, POSE, POSE, h, w)  # [B, n_parts, 4, 4, h, w]
        mu = mu.permute(0, 1, 4, 5, 2, 3).reshape(b, -1, POSE, POSE)  # μ_i  [B, n_parts·h·w, 4, 4]
        part_routing, object_routing = (cast(HeinsenRouting, r) for r in self.routings)
        parts = part_routing.route(a, mu)  # a_j [B, n_parts], μ_j [B, n_parts, 4, 4]
        objects = object_routing.route(parts.scores, parts.poses)  # [B, n_classes], [B, n_classes, 4, 4]
        logits = full_precision(objects.scores)
        return HeinsenCapsNetOutput(
            objects.poses.flatten(-2),
            torch.sigmoid(logits),
            logits.argmax(dim=1),
            None,
            objects.weights if return_coupling else None,
            logits,
        )

    def loss(
        self, out: HeinsenCapsNetOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy of the class scores a_j (the authors' loss). Returns (total, parts as detached tensors)."""
        ce = F.cross_entropy(out.logits, labels.long())
        return ce, {"cross_entropy": ce.detach(), "total": ce.detach()}


__all__ = ["HeinsenCapsNet", "HeinsenCapsNetOutput", "coordinate_grid"]
