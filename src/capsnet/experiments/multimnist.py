"""MultiMNIST (§6): two overlapping digits of different classes, generated on the fly on the training device.

Paper, §6: each 28×28 digit is shifted by up to 4 pixels in each direction on a 36×36 image and overlaid on a
digit of a *different class* from the same set, shifted likewise; the training set pairs every training digit
with 1,000 others (60M pairs for MNIST). The network is trained with the margin loss on both digits (multi-hot
targets, Eq. 4) and the decoder reconstructs each digit from its own capsule, against that digit's own shifted
image; a pair counts as correct when the two longest digit capsules are exactly its two classes.

Here:
- the digit is zero-padded to 36×36 (4 px each side), then shifted by an integer (dy, dx) drawn uniformly from
  [-4, 4]², independently for the two digits; the two are combined by their sum clipped to 1 (`combine="sum"`,
  the official code's `mnist_shift.py`: the uint8 sum clipped at 255) or by the pixel-wise max (`combine="max"`);
- an epoch is `pairs_per_digit` rounds; each round visits every training digit once (a fresh seeded
  permutation, sharded over torchrun ranks) as the first digit, and draws its partner uniformly among all
  training digits of another class. Every random draw comes from a generator seeded by
  (seed, epoch, round, batch, rank): no files, nothing stored, and a resumed run regenerates the same pairs;
- the test set is a fixed set of `test_pairs_per_digit` × n_test pairs from the test split, drawn once from
  `seed` on the CPU and rendered batch by batch on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from ..data.augment import place_on_canvas
from ..data.batching import num_batches, shard_indices
from ..data.split import Split
from ..errors import ConfigError, DatasetError
from ..nn.losses import reconstruction_loss
from ..pixels import to_float
from ..training.evaluator import evaluate_batches
from ..training.tasks import Batch, Task, seeded_generator

Combine = Literal["max", "sum"]
# The Efficient-CapsNet authors' MultiMNIST (EscVM/Efficient-CapsNet: config.json, utils/pre_process_multimnist.py),
# for MultiMNISTTask with EfficientCapsNetConfig.for_multimnist(): digits padded to 36×36 and shifted by up to
# ±6 px, overlaid by their sum clipped to 1; an epoch of 10 pairs per training digit (their 10 × 60,000 / 16 steps
# of 16 pairs); 1,000 test pairs per test digit. (Their training generator also pairs digits of one class; this
# task always pairs two classes, as their test set does.)
EFFICIENT_CAPSNET_SETTING: dict[str, Any] = {
    "max_shift": 6,
    "combine": "sum",
    "pairs_per_digit": 10,
    "test_pairs_per_digit": 1000,
}
_TAG_TRAIN, _TAG_TEST = 0x4D4D, 0x7E57  # keep the train and test random streams apart


# ------------------------------------------------------------------------------------------- generation
class PairSampler:
    """Draws a partner of a different class for each first digit, uniformly among all such digits of a split."""

    def __init__(self, labels: torch.Tensor, n_classes: int):
        labels = labels.long()
        if len(torch.unique(labels)) < 2:
            raise DatasetError("MultiMNIST needs digits of at least two different classes")
        self.by_class = torch.argsort(labels, stable=True)  # split indices sorted by class  [N]
        self.counts = torch.bincount(labels, minlength=n_classes)  # digits per class  [n]
        self.starts = torch.cumsum(self.counts, 0) - self.counts  # first position of each class in by_class
        self.n = len(labels)

    def to(self, device: torch.device) -> PairSampler:
        for name in ("by_class", "counts", "starts"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def partners(self, first_labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """first_labels [B] → partner indices [B] into the split, each of a different class than its first digit.

        Draw k uniformly from the N - count[y] digits whose class is not y, then skip the block of class y in the
        class-sorted order: a single vectorised draw, no rejection loop.
        """
        y = first_labels.to(self.counts.device).long()
        others = (self.n - self.counts[y]).to(torch.float64)  # how many digits have another class  [B]
        u = torch.rand(len(y), generator=generator, device=generator.device, dtype=torch.float64)
        k = (u.to(others.device) * others).long().clamp_max(others.long() - 1)  # [B] in [0, others)
        k = torch.where(k >= self.starts[y], k + self.counts[y], k)
        return self.by_class[k]


def draw_shifts(n: int, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Integer shifts [n, 4] = (dy_a, dx_a, dy_b, dx_b), each uniform in [-max_shift, max_shift]."""
    return torch.randint(-max_shift, max_shift + 1, (n, 4), generator=generator, device=generator.device)


def render_pairs(
    first: torch.Tensor, second: torch.Tensor, shifts: torch.Tensor, *, canvas: int = 36, combine: Combine = "sum"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Overlay two digits. first, second float [B, C, h, w] in [0, 1]; shifts int [B, 4] (dy_a, dx_a, dy_b, dx_b).

    Returns (pair [B, C, canvas, canvas], first placed, second placed): each digit centred on the canvas
    (offset (canvas - h) // 2) and moved by its own shift; the pair is their pixel-wise max or clipped sum.
    """
    off = (canvas - first.shape[-1]) // 2
    shifts = shifts.to(first.device)
    a = place_on_canvas(first, off + shifts[:, 0], off + shifts[:, 1], canvas)
    b = place_on_canvas(second, off + shifts[:, 2], off + shifts[:, 3], canvas)
    pair = torch.maximum(a, b) if combine == "max" else (a + b).clamp_(max=1.0)
    return pair, a, b


def multi_hot(a: torch.Tensor, b: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Labels a, b [B] → targets [B, n] with ones at both classes."""
    t = torch.zeros(len(a), n_classes, device=a.device)
    t.scatter_(1, a.long()[:, None], 1.0)
    t.scatter_(1, b.long()[:, None], 1.0)
    return t


# ---------------------------------------------------------------------------------------- metric, loss
def two_longest_correct(lengths: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The paper's MultiMNIST criterion (§6): the two longest capsules are exactly the two true classes.

    lengths [B, n] (capsule lengths or class probabilities); targets multi-hot [B, n] with two ones.
    Returns bool [B].
    """
    top2 = lengths.topk(2, dim=1).indices  # [B, 2]
    predicted = torch.zeros_like(lengths, dtype=torch.bool).scatter_(1, top2, True)
    return (predicted == (targets > 0)).all(dim=1)


def pair_loss(
    model: Any,  # CapsNet (or a model with capsules like it), or the baseline CNN
    out,
    targets: torch.Tensor,
    recon_b: torch.Tensor | None,
    images_a: torch.Tensor,
    images_b: torch.Tensor,
) -> torch.Tensor:
    """§6 training loss: margin loss with multi-hot targets (both digits, Eq. 4) + recon_weight × the summed
    squared error of each digit's reconstruction (from its own capsule) against its own shifted image.

    A model without capsules (the baseline CNN) gets its own `loss` with the multi-hot targets.
    """
    if out.capsules is None:
        return model.loss(out, images_a, targets)[0]
    cfg = model.config
    loss = model.margin_loss(out.lengths, targets)
    if out.reconstructions is not None and recon_b is not None and cfg.recon_weight > 0:
        for recon, target in ((out.reconstructions, images_a), (recon_b, images_b)):
            loss = loss + reconstruction_loss(recon, target, weight=cfg.recon_weight, reduction=cfg.recon_reduction)
    return loss


class PairForward(nn.Module):
    """Runs the model and reconstructs both digits, each from its own capsule (decoder masked by its label).

    It is this module that DistributedDataParallel wraps, so every decoder call is inside one forward.
    forward(images [B, C, 36, 36], label_a [B], label_b [B]) → (model output with the reconstruction of digit a,
    reconstruction of digit b or None).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images, label_a, label_b):
        out = self.model(images, label_a)
        decoder = getattr(self.model, "decoder", None)
        cfg: Any = self.model.config
        if decoder is None or out.capsules is None or (self.model.training and cfg.recon_weight == 0):
            return out, None  # (with recon_weight 0 the decoder gets no gradient, which DDP rejects)
        if not (self.model.training and cfg.decoder_mask == "label"):  # the output's reconstruction used another mask
            out = out._replace(reconstructions=decoder(out.capsules, label_a))
        return out, decoder(out.capsules, label_b)


# ------------------------------------------------------------------------------------------------ task
class MultiMNISTTask(Task):
    """MultiMNIST training and test (§6) for the loop in `capsnet.training`."""

    name = "multimnist"
    image_size: int  # the square canvas
    digits = True

    def __init__(
        self,
        *,
        train: Split,
        test: Split,
        val: Split | None = None,
        n_classes: int = 10,
        pairs_per_digit: int = 1000,
        test_pairs_per_digit: int = 1,
        max_shift: int = 4,
        canvas: int = 36,
        combine: Combine = "sum",
        seed: int = 0,
    ):
        if pairs_per_digit < 1 or test_pairs_per_digit < 1:
            raise ConfigError("pairs_per_digit and test_pairs_per_digit must be >= 1")
        if max_shift < 0 or canvas < train.images.shape[-1]:
            raise ConfigError(f"need max_shift >= 0 and a canvas of at least {train.images.shape[-1]} px")
        if combine not in ("max", "sum"):
            raise ConfigError(f"combine must be 'max' or 'sum', got {combine!r}")
        self.train, self.test, self.val = train, test, val
        self.in_channels, self.image_size, self.n_classes = train.images.shape[1], canvas, n_classes
        self.pairs_per_digit, self.max_shift, self.combine = pairs_per_digit, max_shift, combine
        self._sampler = PairSampler(train.labels, n_classes)
        self._on: dict[str, tuple[torch.Tensor, torch.Tensor, PairSampler]] = {}
        pairs = {"pairs_per_digit": test_pairs_per_digit, "max_shift": max_shift}
        self.test_pairs = make_test_pairs(test, n_classes, seed=seed, **pairs)
        self.val_pairs = make_test_pairs(val, n_classes, seed=seed + 1, **pairs) if val is not None else None

    @property
    def has_val(self) -> bool:
        return self.val is not None

    def _device_copy(self, device: torch.device):
        key = str(device)
        if key not in self._on:  # the uint8 training set lives on the device: 47 MB for MNIST
            sampler = PairSampler(self.train.labels, self.n_classes).to(device)
            self._on = {key: (self.train.images.to(device), self.train.labels.to(device), sampler)}
        return self._on[key]

    def per_round(self, *, batch_size: int, world_size: int) -> int:
        return num_batches(len(self.train), batch_size=batch_size, world_size=world_size)

    def num_batches(self, *, batch_size: int, world_size: int) -> int:
        return self.pairs_per_digit * self.per_round(batch_size=batch_size, world_size=world_size)

    def batches(self, *, epoch, batch_size, seed, rank, world_size, device, generator, start=0) -> Iterator[Batch]:
        images, labels, sampler = self._device_copy(device)
        n, per_round = len(self.train), self.per_round(batch_size=batch_size, world_size=world_size)
        for rnd in range(start // per_round, self.pairs_per_digit):
            order = torch.randperm(n, generator=seeded_generator(torch.device("cpu"), seed, epoch, rnd, _TAG_TRAIN))
            mine = shard_indices(order, rank=rank, world_size=world_size)  # wraps: every rank gets as many pairs
            first_k = start - rnd * per_round if rnd == start // per_round else 0
            for k in range(first_k, per_round):
                ia = mine[k * batch_size : (k + 1) * batch_size].to(device)
                g = seeded_generator(device, seed, epoch, rnd, k, rank, _TAG_TRAIN)
                ib = sampler.partners(labels[ia], g)
                yield self._render(images, labels, ia, ib, draw_shifts(len(ia), self.max_shift, g))

    def _render(self, images, labels, ia, ib, shifts) -> Batch:
        xa, xb = to_float(images[ia]), to_float(images[ib])
        pair, a, b = render_pairs(xa, xb, shifts, canvas=self.image_size, combine=self.combine)
        la, lb = labels[ia], labels[ib]
        extras = {"label_a": la, "label_b": lb, "image_a": a, "image_b": b}
        return Batch(pair, multi_hot(la, lb, self.n_classes), extras)

    def wrap(self, model: nn.Module) -> nn.Module:
        return PairForward(model)

    def forward(self, module, batch):
        return module(batch.images, batch.extras["label_a"], batch.extras["label_b"])

    def loss(self, model, out, batch) -> tuple[torch.Tensor, torch.Tensor]:
        out, recon_b = out
        loss = pair_loss(model, out, batch.targets, recon_b, batch.extras["image_a"], batch.extras["image_b"])
        return loss, two_longest_correct(out.lengths.detach(), batch.targets).sum()

    def evaluate(self, model, *, split="test", batch_size, device, dist) -> dict:
        """Loss and two-longest accuracy on the fixed pairs of the "val" or "test" digits."""
        digits, fixed = (self.val, self.val_pairs) if split == "val" else (self.test, self.test_pairs)
        if digits is None or fixed is None or split not in ("val", "test"):
            raise ConfigError(f"this MultiMNIST task has no {split!r} split")
        images, labels = digits.images.to(device), digits.labels.to(device)
        ia, ib, shifts = (t[dist.rank :: dist.world_size].to(device) for t in fixed)

        def batches():
            for s in range(0, len(ia), batch_size):
                sl = slice(s, s + batch_size)
                yield self._render(images, labels, ia[sl], ib[sl], shifts[sl])

        def score(m, batch):
            out, recon_b = PairForward(m)(batch.images, batch.extras["label_a"], batch.extras["label_b"])
            loss = pair_loss(m, out, batch.targets, recon_b, batch.extras["image_a"], batch.extras["image_b"])
            return loss, two_longest_correct(out.lengths, batch.targets).sum()

        return evaluate_batches(model, batches(), score=score, device=device, dist=dist, lengths=True)


def make_test_pairs(
    test: Split, n_classes: int, *, pairs_per_digit: int = 1, max_shift: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed test pairs: (first indices [M], partner indices [M], shifts [M, 4]), M = pairs_per_digit × n_test;
    every test digit is a first digit pairs_per_digit times. Drawn on the CPU from `seed` alone."""
    g = seeded_generator(torch.device("cpu"), seed, _TAG_TEST)
    ia = torch.arange(len(test)).repeat(pairs_per_digit)
    ib = PairSampler(test.labels, n_classes).partners(test.labels[ia], g)
    return ia, ib, draw_shifts(len(ia), max_shift, g)


def generate(
    split: Split,
    n_pairs: int,
    *,
    n_classes: int = 10,
    max_shift: int = 4,
    canvas: int = 36,
    combine: Combine = "sum",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """A standalone batch of `n_pairs` MultiMNIST pairs (for inspection and tests), deterministic under `seed`.

    Returns images [n, C, canvas, canvas], targets [n, n_classes], label_a/label_b [n], image_a/image_b (each
    digit alone, placed) and shifts [n, 4].
    """
    device = torch.device(device)
    g = seeded_generator(device, seed, _TAG_TRAIN, n_pairs)
    ia = torch.randint(0, len(split), (n_pairs,), generator=g, device=device)
    labels = split.labels.to(device)
    ib = PairSampler(split.labels, n_classes).to(device).partners(labels[ia], g)
    shifts = draw_shifts(n_pairs, max_shift, g)
    xa, xb = to_float(split.images.to(device)[ia]), to_float(split.images.to(device)[ib])
    pair, a, b = render_pairs(xa, xb, shifts, canvas=canvas, combine=combine)
    targets = multi_hot(labels[ia], labels[ib], n_classes)
    return {
        "images": pair,
        "targets": targets,
        "label_a": labels[ia],
        "label_b": labels[ib],
        "image_a": a,
        "image_b": b,
        "shifts": shifts,
    }
