"""The one evaluator: a model's loss, accuracy, per-class accuracy and confusion matrix over batches of its input.

Training's validation and test (every Task), `capsnet evaluate` and `capsnet.evaluate` all score here. The batches
hold the model's prepared input (its recipe applied); the sums stay on the device until the end (one read) and are
summed over torchrun ranks, each rank scoring its own share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from ..data.scaling import channel_stats
from ..data.split import Split
from ..models.recipe import model_input
from . import distributed as dist_utils
from .tasks import Batch

Score = Callable[[nn.Module, Batch], tuple[torch.Tensor, torch.Tensor]]  # (loss, number correct) of one batch


def input_config(model: nn.Module) -> Any:
    """The model's config when it records its input (a capsnet model's), else None (a module of one's own)."""
    cfg = getattr(model, "config", None)
    return cfg if all(hasattr(cfg, k) for k in ("in_channels", "image_size", "n_classes")) else None


def standardizes_channels(model: nn.Module) -> bool:
    """Whether `model` (or a member of an ensemble) standardizes each channel with the scored split's statistics."""
    return any(getattr(getattr(m, "config", None), "channel_standardize", False) for m in model.modules())


@torch.no_grad()
def evaluate_batches(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    device: torch.device,
    dist: dist_utils.DistInfo | None = None,
    n_classes: int | None = None,
    score: Score | None = None,
    lengths: bool = False,
) -> dict[str, Any]:
    """{"accuracy", "loss", "n"} of `model` (in eval mode) on `batches` (this rank's share), summed over ranks; with
    `n_classes`, also "per_class" accuracy and the "confusion" matrix (rows: true class, columns: predicted; a
    prediction outside [0, n_classes) counts as wrong and in no column).

    By default a batch is scored as a classification at test time: `model(images)` without the labels (a decoder
    sees the predicted class), the model's loss and its `.predictions`. `score(model, batch) -> (loss, n correct)`
    scores a task of another kind (MultiMNIST's pairs); it gives no confusion matrix. With `lengths`, where the
    model's outputs carry class `.lengths` [B, n_classes]: "shortest" and "longest", the mean over images of the
    shortest and the longest, and "classes", their number (capsnet.training.stuck reads them).
    """
    dist = dist or dist_utils.DistInfo()
    was_training = model.training
    model.eval()
    width = (n_classes + 1) if n_classes is not None and score is None else 0
    # [loss sum, correct, count, confusion (n_classes rows of width, the last column: outside the classes)]
    sums = torch.zeros(3 + (n_classes or 0) * width, dtype=torch.float64, device=device)
    ends = torch.zeros(3, dtype=torch.float64, device=device)  # Σ shortest, Σ longest class length, images
    widths: set[int] = set()  # the class lengths' n_classes (a shape: no device read)
    hook = model.register_forward_hook(lambda _m, _i, out: _add_lengths(ends, widths, out)) if lengths else None
    try:
        _score_batches(model, batches, sums, score=score, n_classes=n_classes, width=width, device=device)
    finally:
        if hook is not None:
            hook.remove()
    model.train(was_training)
    flat = dist_utils.all_sum_tensor(torch.cat([sums, ends]), dist).cpu()
    loss_sum, correct, count = flat[:3].tolist()
    result: dict[str, Any] = {"accuracy": correct / max(count, 1), "loss": loss_sum / max(count, 1), "n": int(count)}
    if width:
        assert n_classes is not None
        counts = flat[3:-3].view(n_classes, width)
        confusion, totals = counts[:, :n_classes], counts.sum(dim=1)
        result["per_class"] = [
            (confusion[k, k] / totals[k]).item() if totals[k] > 0 else float("nan") for k in range(n_classes)
        ]
        result["confusion"] = confusion.long().tolist()
    shortest, longest, measured = flat[-3:].tolist()
    if measured:  # the model's outputs have class lengths (or probabilities)
        result.update({"shortest": shortest / measured, "longest": longest / measured, "classes": max(widths)})
    return result


def _score_batches(model, batches, sums, *, score, n_classes, width, device) -> None:
    """Add each batch's loss sum, correct count, count and (`width`) confusion counts to `sums`."""
    for batch in batches:
        n = batch.targets.shape[0]  # (an ensemble's input is [members, B, C, H, W])
        if score is not None:
            loss, n_correct = score(model, batch)
            predicted = None
        else:
            out = model(batch.images)
            loss, _ = cast(Any, model).loss(out, batch.images, batch.targets)
            predicted = out.predictions.long()
            n_correct = (predicted == batch.targets).sum()
        sums[0] += loss.detach().double() * n
        sums[1] += torch.as_tensor(n_correct, device=device).double()
        sums[2] += n
        if width and predicted is not None:
            assert n_classes is not None
            predicted = torch.where((predicted >= 0) & (predicted < n_classes), predicted, n_classes)
            cell = 3 + batch.targets.long() * width + predicted  # confusion[true, predicted], flattened
            sums.index_add_(0, cell, torch.ones_like(cell, dtype=torch.float64))


def _add_lengths(sums: torch.Tensor, widths: set[int], out: Any) -> None:
    """Add a forward's shortest and longest class length [B, n_classes] (its `.lengths`), summed over the batch,
    and its batch size to `sums`; its n_classes to `widths`."""
    lengths = getattr(out, "lengths", None)
    if isinstance(lengths, torch.Tensor) and lengths.dim() == 2 and lengths.shape[1] > 1:
        widths.add(lengths.shape[1])
        ends = lengths.detach().double()
        sums += torch.stack([ends.min(dim=1).values.sum(), ends.max(dim=1).values.sum(), ends.new_tensor(len(ends))])


def split_batches(
    model: nn.Module,
    split: Split,
    *,
    batch_size: int,
    device: torch.device,
    dist: dist_utils.DistInfo,
    stats: Any = None,
) -> Iterable[Batch]:
    """This rank's share of `split` (every world_size-th image) as batches of the model's input (its recipe:
    capsnet.models.recipe.model_input), on `device`."""
    images, labels = split.images[dist.rank :: dist.world_size], split.labels[dist.rank :: dist.world_size]
    for start in range(0, len(labels), batch_size):
        x = model_input(model, images[start : start + batch_size].to(device), stats=stats)
        yield Batch(x, labels[start : start + batch_size].to(device))


def evaluate(
    model: nn.Module,
    split: Split,
    *,
    batch_size: int = 250,
    device: str | torch.device = "cpu",
    dist: dist_utils.DistInfo | None = None,
) -> dict[str, Any]:
    """Test-time metrics of `model` on `split`: accuracy, n, loss (the mean training loss on these images),
    per_class accuracy and the confusion matrix (`evaluate_batches`). Under torchrun each rank takes every
    world_size-th image and the counts are summed over ranks.

    Every batch reaches the model through its input recipe (capsnet.models.recipe.model_input: centre crop,
    scaling; a model that standardizes each channel, with `split`'s own statistics). A module of one's own
    (capsnet.fit's protocol) without a recipe gets the images ÷ 255, and the classes are those of the labels
    (0 ... max label).
    """
    dist = dist or dist_utils.DistInfo()
    device = torch.device(device)
    cfg = input_config(model)
    n_classes: int = cfg.n_classes if cfg is not None else int(split.labels.max()) + 1 if len(split) else 1
    stats = channel_stats(split) if standardizes_channels(model) else None  # (the split's own, as the authors')
    batches = split_batches(model, split, batch_size=batch_size, device=device, dist=dist, stats=stats)
    return evaluate_batches(model, batches, device=device, dist=dist, n_classes=n_classes)
