"""Homogeneous vector capsules (Byerly, Kalganova & Dear, "No routing needed between capsules", Neurocomputing
463, 2021; arXiv 2001.09136): a branching and merging CNN whose class capsules come from element-wise weights,
with no routing.

Architecture (the paper's MNIST network, as in the authors' code, github.com/AdamByerly/BMCNNwHFCs, python/models
and python/run_experiments.py):

    conv k = 1..9   3×3, no padding, no bias, BatchNorm (a learned shift β only) and ReLU; 32 channels growing by
                    16 per layer (32, 48, ..., 160); maps 28 → 26 → ... → 10
    branches        after conv 3 (22×22×64), conv 6 (16×16×112) and conv 9 (10×10×160). Each branch's feature map
                    becomes N primary capsules u_i of D dimensions: "position" capsules (the default, the authors'
                    2021 code) are the D = C channels at each of the N = H·W positions; "filter" capsules (the
                    arXiv v1-v5 "homogeneous filter capsules") are the N = C feature maps, of D = H·W each.
    HVCs            class capsule j of branch b:  v_j = ReLU(BN(Σ_i u_i ⊙ W_ij))   W [n_classes, N, D]   (§3)
                    the Hadamard product keeps the D dimensions apart, so no routing is needed to untangle them;
                    BN normalises each dimension d over the batch and the class capsules, with a shift β only
    merge           each branch scores class j by the length |v_j|; the three scores are weighted by learned
                    branch weights w_b (initialised to 1, the paper's best merge strategy), batch-normalised per
                    branch (shift β only) and summed: logits_j = Σ_b BN(w_b |v_j^(b)|)           [B, n_classes]

trained with softmax cross-entropy on the logits. `branch_merge="equal"` fixes the branch weights at 1 (the
paper's other strategy).

Parameters of the MNIST network, layer by layer (BatchNorm's running statistics are buffers, not parameters):

    convolutions    9 · Σ_k c_{k-1} c_k = 9 · 84,000 = 756,000, and their BN shifts Σ_k c_k = 864
    HVC weights     10 · (22·22 · 64 + 16·16 · 112 + 10·10 · 160) = 10 · 75,648 = 756,480 (either layout)
    HVC BN shifts   one per capsule dimension: 64 + 112 + 160 = 336 (filter capsules: 484 + 256 + 100 = 840)
    merge           branch weights 3, BN shifts 3
    total           1,513,686 (the authors' 2021 code); filter capsules with equal branch weights: 1,514,187,
                    the figure listed for the paper (Papers with Code, "trainable parameters")

Training recipe (the authors' code; the paper's 300 epochs): Adam, lr 1e-3 decayed by 0.98 per epoch, batch 120,
and their MNIST augmentation (capsnet.data.hvc_augment: random rotation, translation within the margins, width
squish and a 4×4 erasure), `--augment hvc`. Inputs are centred to [-1, 1] as the authors' pipeline does. The
authors also evaluate an exponential moving average of the weights (decay 0.999), with BatchNorm statistics
averaged as slowly (decay 0.9997); capsnet's training loop keeps no weight average, so the running statistics
follow the current weights instead (momentum 0.1: with 0.01, validation accuracy on the bundled sample lagged
at 11-73% for 8 epochs while the same weights scored 97% on fresh statistics). docs/fidelity.md lists this and
the other differences.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..configs.hvc_capsnet import HVCCapsNetConfig
from ..nn.losses import full_precision
from ..nn.standardize import per_image_standardize
from .inputs import check_images
from .pretrained import Pretrained
from .registry import register_model

BN_EPS = 1e-3  # the authors' BatchNorm epsilon
INIT_STD = 0.05  # the authors' weights start from N(0, 0.05²) (TensorFlow 2's random_normal_initializer)


class BatchNormShift(nn.Module):
    """BatchNorm with a learned shift β and no scale (the authors' tf.nn.batch_normalization(..., scale=None)):
    y = (x − μ) / sqrt(σ² + ε) + β, statistics over every dimension but dim 1 (batch statistics in training,
    running ones in evaluation). x [B, n, ...]."""

    def __init__(self, n: int, *, momentum: float, eps: float = BN_EPS):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.beta = nn.Parameter(torch.zeros(n))
        self.running_mean: torch.Tensor
        self.running_var: torch.Tensor
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))
        # γ = 1, not learned and not saved, passed because CUDA's native batch norm without a γ fails its backward
        # in evaluation mode ("tensor does not have a device", torch 2.11), and cuDNN's is used only with a γ.
        self.unit_scale: torch.Tensor
        self.register_buffer("unit_scale", torch.ones(n), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.unit_scale, self.beta, self.training, self.momentum, self.eps
        )


class HomogeneousVectorCapsules(nn.Module):
    """N input capsules of D dimensions → M output capsules of D dimensions by element-wise weights (§3):
    v_j = ReLU(BN(Σ_i u_i ⊙ W_ij)), W [M, N, D]. No routing: every input capsule feeds every output capsule."""

    def __init__(self, n_in: int, n_out: int, dim: int, *, momentum: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in, dim) * INIT_STD)
        self.norm = BatchNormShift(dim, momentum=momentum)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u [B, N, D] -> v [B, M, D]."""
        s = torch.einsum("bnd,mnd->bdm", u, self.weight)  # Σ_i u_i ⊙ W_ij, dimension-major  [B, D, M]
        return F.relu(self.norm(s)).transpose(1, 2)  # BN per dimension over batch and capsules  [B, M, D]


def _conv_block(c_in: int, c_out: int, momentum: float) -> nn.Sequential:
    """3×3 convolution (no padding, no bias), BatchNorm (shift only), ReLU: [B, c_in, H, W] -> [B, c_out, H-2, W-2]."""
    conv = nn.Conv2d(c_in, c_out, 3, bias=False)
    nn.init.normal_(conv.weight, 0.0, INIT_STD)
    return nn.Sequential(conv, BatchNormShift(c_out, momentum=momentum), nn.ReLU(inplace=True))


class HVCOutput(NamedTuple):
    """Mirrors `capsnet.CapsNetOutput` so that training, evaluation and prediction treat HVCs alike."""

    capsules: torch.Tensor  # class capsules v_j of the deepest branch  [B, n_classes, D]
    lengths: torch.Tensor  # softmax of the merged logits: class probabilities  [B, n_classes]
    predictions: torch.Tensor  # argmax_j  [B]
    reconstructions: None
    coupling: None
    logits: torch.Tensor  # Σ_b BN(w_b |v_j^(b)|)  [B, n_classes]
    branch_lengths: torch.Tensor  # |v_j^(b)| of each branch  [B, n_classes, n_branches]


@register_model
class HVCCapsNet(Pretrained, nn.Module):
    """Byerly et al.'s branching and merging CNN with homogeneous vector capsules: 1,513,686 parameters on MNIST.

    `HVCCapsNet()` builds the paper's network; options are keyword-only and mirror `HVCCapsNetConfig`, or
    pass `config=`. `small` is a narrower network for CPU runs."""

    config_class = HVCCapsNetConfig
    model_type = "hvc-capsnet"
    paper = "Byerly, Kalganova & Dear, Neurocomputing 2021"
    designed_for = "MNIST 28x28 (also Fashion-MNIST, CIFAR-10)"
    routing_method = "none"
    default_lr = 1e-3  # the authors' Adam learning rate
    default_lr_decay = 0.98  # their exponential decay per epoch
    default_batch_size = 120  # their batch size
    # their MNIST augmentation on MNIST-format sets, under `--augment auto` (capsnet.training.recipes)
    data_recipes: ClassVar[dict[str, dict[str, str]]] = {"idx": {"augment": "hvc"}}

    def __init__(self, *, config: HVCCapsNetConfig | None = None, **options: Any):
        super().__init__()
        self.config = cfg = self.make_config(config, options)
        channels = (cfg.in_channels, *cfg.channels)
        self.convs = nn.ModuleList(
            [_conv_block(c_in, c_out, cfg.bn_momentum) for c_in, c_out in itertools.pairwise(channels)]
        )
        self.hvcs = nn.ModuleDict(
            {
                str(k): HomogeneousVectorCapsules(n, cfg.n_classes, d, momentum=cfg.bn_momentum)
                for k, (n, d) in ((k, cfg.branch_capsules(k)) for k in cfg.branches_after)
            }
        )  # one per branch, keyed by the convolution it leaves from
        n_branches = len(cfg.branches_after)
        self.branch_weights: torch.Tensor  # w_b  [n_branches]
        if cfg.branch_merge == "learned":
            self.branch_weights = nn.Parameter(torch.ones(n_branches))
        else:
            self.register_buffer("branch_weights", torch.ones(n_branches))
        self.merge_norm = BatchNormShift(n_branches, momentum=cfg.bn_momentum)

    @classmethod
    def small(cls, **overrides: Any) -> HVCCapsNet:
        """The paper's network at half the width (16, 24, ..., 80 channels), for CPU runs: see docs/benchmarks.md."""
        return cls(**{"channels": SMALL_CHANNELS, **overrides})

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None, **_: Any) -> HVCOutput:
        """images [B, C, H, W] in [0, 1]; `labels` is accepted (and unused) so it is called like CapsNet."""
        cfg = self.config
        check_images(images, channels=cfg.in_channels, size=cfg.image_size, model="HVCCapsNet")
        x = per_image_standardize(images) if cfg.standardize else images * 2 - 1  # the authors' centring to [-1, 1]
        lengths: list[torch.Tensor] = []
        for k, conv in enumerate(self.convs, start=1):
            x = conv(x)  # [B, C_k, H - 2k, W - 2k]
            if str(k) in self.hvcs:
                # position capsules: the channels at each position [B, H·W, C]; filter: each map [B, C, H·W]
                u = x.flatten(2).transpose(1, 2) if cfg.capsule_layout == "position" else x.flatten(2)
                capsules = self.hvcs[str(k)](u)  # class capsules v_j  [B, n_classes, D]
                lengths.append(torch.linalg.vector_norm(capsules, dim=-1))  # |v_j|  [B, n_classes]
        branch = torch.stack(lengths, dim=1)  # [B, n_branches, n_classes]
        # Merge: BN over batch and classes per branch, then the sum over branches
        logits = self.merge_norm(branch * self.branch_weights[:, None]).sum(dim=1)  # [B, n_classes]
        probs = full_precision(logits).softmax(dim=1)
        return HVCOutput(capsules, probs, logits.argmax(dim=1), None, None, logits, branch.transpose(1, 2))

    def loss(
        self, out: HVCOutput, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Softmax cross-entropy of the merged logits (the authors' loss); multi-hot targets [B, n] (MultiMNIST) are
        normalised to a distribution, as for the baseline CNN. Returns (total, parts as detached tensors)."""
        logits = full_precision(out.logits)
        if labels.dim() == 1:
            ce = F.cross_entropy(logits, labels.long())
        elif labels.dim() == 2 and labels.shape[1] == self.config.n_classes:
            ce = F.cross_entropy(logits, labels.float() / labels.float().sum(dim=1, keepdim=True).clamp_min(1.0))
        else:
            raise ValueError(f"labels must be [B] indices or [B, {self.config.n_classes}] multi-hot targets")
        return ce, {"cross_entropy": ce.detach(), "total": ce.detach()}


SMALL_CHANNELS = (16, 24, 32, 40, 48, 56, 64, 72, 80)
