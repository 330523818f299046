"""`capsnet visualize`: figures of a trained CapsNet (reconstructions, the paper's Fig. 4 perturbations,
routing coefficients, training curves, confusion matrix), written as PNG files.

matplotlib is optional (`pip install 'capsnet[viz]'`) and imported only when a figure is drawn. Figures are
built with the object-oriented API (`matplotlib.figure.Figure`, rendered by Agg) so nothing here touches
pyplot's global state or backend: it works headless and leaves a notebook's inline backend alone.
Output is deterministic for a fixed checkpoint and seed (PNG metadata carries no version or date).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..data.split import Split
from ..errors import CapsNetError, CheckpointError, DatasetError
from ..inference import fit_to_model
from ..pixels import to_float
from ..training.checkpoint import SUMMARY_NAME, read_summary
from ..training.checkpoint_data import check_split, checkpoint_data
from ..training.evaluator import evaluate
from .common import (
    WRONG,
    _figure,
    _forward,
    _frame,
    _gray,
    _model_device,
    _mosaic,
    _save,
    distinct_classes,
    load_capsnet,
    run_folder_of,
    select_examples,
)
from .routing import plot_routing

__all__ = [
    "PERTURBATION_OFFSETS",
    "confusion_matrix",
    "perturbed_reconstructions",
    "plot_confusion",
    "plot_curves",
    "plot_perturbation",
    "plot_reconstructions",
    "visualize",
]

# Fig. 4 of the paper: each dimension tweaked by -0.25 .. 0.25 in steps of 0.05 (11 values).
PERTURBATION_OFFSETS: tuple[float, ...] = tuple(round(0.05 * k, 2) for k in range(-5, 6))


def _need_decoder(model, what: str) -> None:
    if getattr(model, "decoder", None) is None:
        raise CapsNetError(f"{what} needs a CapsNet with a decoder (this one was built with decoder=False)")


def plot_reconstructions(
    model, images: torch.Tensor, labels: torch.Tensor, out: str | os.PathLike, *, per_row: int = 10
) -> Path:
    """Inputs above their reconstructions (the decoder masked by the predicted capsule, as at test time),
    each titled with the predicted and true label; wrong predictions in red."""
    _need_decoder(model, "plot_reconstructions")
    o = _forward(model, images)
    x = to_float(images.cpu())
    recon, pred = o.reconstructions.cpu(), o.predictions.cpu()
    n = len(x)
    cols = min(per_row, n)
    groups = math.ceil(n / cols)
    fig = _figure(figsize=(1.15 * cols + 1.3, 2.75 * groups + 0.5), layout="constrained")
    axes = fig.subplots(2 * groups, cols, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    for k in range(n):
        g, c = divmod(k, cols)
        top, bottom = axes[2 * g, c], axes[2 * g + 1, c]
        for ax in (top, bottom):
            ax.set_axis_on()
        _gray(top, x[k])
        _gray(bottom, recon[k])
        wrong = int(pred[k]) != int(labels[k])
        color = WRONG if wrong else "black"
        top.set_title(
            f"pred {int(pred[k])}\ntrue {int(labels[k])}",
            fontsize=10,
            color=color,
            fontweight="bold" if wrong else "normal",
        )
        if wrong:
            _frame(top, WRONG, 2.0)
            _frame(bottom, WRONG, 2.0)
        if c == 0:
            top.set_ylabel("input", fontsize=10)
            bottom.set_ylabel("reconstruction", fontsize=10)
    n_wrong = int((pred != labels.cpu()).sum())
    fig.suptitle(
        f"Reconstructions from the predicted capsule ({n - n_wrong}/{n} predicted correctly; wrong in red)", fontsize=11
    )
    return _save(fig, out)


@torch.no_grad()
def perturbed_reconstructions(
    model, capsules: torch.Tensor, select: int, offsets: tuple[float, ...] = PERTURBATION_OFFSETS
) -> torch.Tensor:
    """Decode `capsules` [n_caps, dim] with dimension d of capsule `select` shifted by each offset:
    images [dim · len(offsets), C, H, W], row-major (dimension, offset)."""
    _need_decoder(model, "perturbed_reconstructions")
    dim = capsules.shape[-1]
    deltas = torch.tensor(offsets, dtype=capsules.dtype, device=capsules.device)
    v = capsules.unsqueeze(0).unsqueeze(0).repeat(dim, len(offsets), 1, 1)  # [dim, n_off, n_caps, dim]
    idx = torch.arange(dim, device=capsules.device)
    v[idx, :, select, idx] += deltas  # row d: dimension d of the selected capsule + each offset
    v = v.flatten(0, 1)
    sel = torch.full((v.shape[0],), select, dtype=torch.long, device=v.device)
    return model.decoder(v, sel).cpu()


def plot_perturbation(
    model,
    images: torch.Tensor,
    labels: torch.Tensor,
    out: str | os.PathLike,
    *,
    offsets: tuple[float, ...] = PERTURBATION_OFFSETS,
) -> Path:
    """The paper's Fig. 4: for each image, every dimension of its predicted digit capsule is shifted by each
    offset and decoded. One panel per image: rows = capsule dimensions, columns = offsets."""
    _need_decoder(model, "plot_perturbation")
    o = _forward(model, images)
    n, dim = len(images), o.capsules.shape[-1]
    rows, cols = dim, len(offsets)
    h, w = images.shape[-2:]
    panel_w = 3.6
    panel_h = panel_w * (rows * (h + 2)) / (cols * (w + 2))
    fig = _figure(figsize=(panel_w * n + 0.9, panel_h + 1.2), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    for k, ax in enumerate(axes):
        p, y = int(o.predictions[k]), int(labels[k])
        grid = perturbed_reconstructions(model, o.capsules[k], p, offsets)
        _gray(ax, _mosaic(grid, rows, cols))
        ax.set_xticks([(w + 2) * j + w / 2 - 0.5 for j in range(len(offsets))])
        ax.set_xticklabels([f"{d:+.2f}".replace("+0.00", "0") for d in offsets], rotation=90, fontsize=7)
        ax.set_yticks([(h + 2) * d + h / 2 - 0.5 for d in range(dim)])
        ax.set_yticklabels([str(d) for d in range(dim)], fontsize=7)
        ax.tick_params(length=0)
        ax.set_xlabel("offset added to the dimension", fontsize=9)
        if k == 0:
            ax.set_ylabel("capsule dimension", fontsize=9)
        wrong = p != y
        ax.set_title(f"capsule {p} (true {y})", fontsize=10, color=WRONG if wrong else "black")
    fig.suptitle("Perturbing each dimension of the predicted digit capsule (paper Fig. 4)", fontsize=11)
    return _save(fig, out)


def plot_curves(summary: str | os.PathLike, out: str | os.PathLike, *, dataset: str | None = None) -> Path:
    """Loss and accuracy per epoch from a run's summary.csv (or the run folder holding it), titled with the data
    set's name: `dataset`, else the one the run's config.json records, else the run folder's name."""
    summary = Path(summary)
    if summary.is_dir():
        summary = summary / SUMMARY_NAME
    dataset = dataset or _trained_on(summary.parent) or summary.parent.name
    rows = read_summary(summary)
    if not rows:
        raise CheckpointError(f"{summary}: no epochs recorded yet")
    if "epoch" not in rows[0]:
        raise CheckpointError(f"{summary}: no 'epoch' column (columns: {', '.join(k for k in rows[0] if k)})")
    cols = {k: [r[k] for r in rows] for k in rows[0] if k}
    epochs = cols["epoch"]

    def present(key: str) -> bool:
        return key in cols and any(math.isfinite(v) for v in cols[key])

    accs = [k for k in ("train_acc", "val_acc", "test_acc") if present(k)]
    chosen_on = "val" if present("val_acc") else "test"  # the split best/ was chosen on
    scale = 100.0 if accs and max(v for k in accs for v in cols[k] if math.isfinite(v)) <= 1.0 else 1.0
    fig = _figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    marker = "o" if len(epochs) <= 30 else None
    curves = (("train", "tab:blue"), ("val", "tab:green"), ("test", "tab:orange"))
    for split, color in curves:
        if present(f"{split}_loss"):
            ax_loss.plot(epochs, cols[f"{split}_loss"], marker=marker, color=color, label=split)
    ax_loss.set_title("loss")
    ax_loss.set_ylabel("loss")
    labels = {split: split for split, _ in curves}
    if present(f"{chosen_on}_acc"):
        best, at = max((v, e) for v, e in zip(cols[f"{chosen_on}_acc"], epochs) if math.isfinite(v))
        labels[chosen_on] += f" (best {best * scale:.2f}{'%' if scale == 100.0 else ''} at epoch {at:g})"
    for split, color in curves:
        if present(f"{split}_acc"):
            ax_acc.plot(
                epochs, [v * scale for v in cols[f"{split}_acc"]], marker=marker, color=color, label=labels[split]
            )
    ax_acc.set_title("accuracy")
    ax_acc.set_ylabel("accuracy (%)" if scale == 100.0 else "accuracy")
    for ax in (ax_loss, ax_acc):
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        if len(epochs) <= 20:
            ax.set_xticks(sorted({int(e) for e in epochs if math.isfinite(e)}))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    fig.suptitle(f"Training curves ({dataset}, {len(epochs)} epochs)", fontsize=11)
    return _save(fig, out)


def _trained_on(run_dir: Path) -> str | None:
    """The data set a run folder's config.json records (`train.dataset`; a path by its folder's name), or None."""
    try:
        name = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["train"]["dataset"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(name).name if isinstance(name, str) and name else None


def confusion_matrix(model, split: Split, *, batch_size: int = 100, limit: int | None = None) -> torch.Tensor:
    """Counts [n_classes, n_classes] (rows: true labels, columns: predictions) over the first `limit` examples
    of `split` (all by default), as `capsnet.training.evaluator` counts them."""
    n = len(split) if limit is None else max(0, min(limit, len(split)))
    if n == 0:
        raise DatasetError("the split holds no images")
    part = Split(images=split.images[:n], labels=split.labels[:n])
    result = evaluate(model, part, batch_size=batch_size, device=_model_device(model))
    return torch.tensor(result["confusion"], dtype=torch.long)


def plot_confusion(confusion, out: str | os.PathLike, *, title: str | None = None) -> Path:
    """A confusion matrix (tensor or list of lists; rows = true labels, columns = predictions), annotated."""
    cm = torch.as_tensor(confusion, dtype=torch.long)
    if cm.dim() != 2 or cm.shape[0] != cm.shape[1]:
        raise CapsNetError(f"a confusion matrix must be square, got shape {list(cm.shape)}")
    k, total = cm.shape[0], int(cm.sum())
    acc = float(cm.diagonal().sum()) / total if total else math.nan
    fig = _figure(figsize=(0.55 * k + 2.6, 0.55 * k + 1.8), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(cm.numpy(), cmap="Blues", vmin=0, vmax=max(1, int(cm.max())), interpolation="nearest")
    thresh = max(1, int(cm.max())) / 2
    size = 9 if k <= 10 else 7
    for i in range(k):
        for j in range(k):
            v = int(cm[i, j])
            if v or i == j:
                ax.text(j, i, str(v), ha="center", va="center", fontsize=size, color="white" if v > thresh else "black")
    ax.set_xticks(range(k))
    ax.set_yticks(range(k))
    ax.set_xlabel("predicted label")
    ax.set_ylabel("true label")
    fig.colorbar(im, ax=ax, shrink=0.8, label="images")
    ax.set_title(title or f"Confusion matrix: {total} images, accuracy {acc:.2%}", fontsize=11)
    return _save(fig, out)


# ------------------------------------------------------------------------------------------- everything


def visualize(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
    seed: int = 0,
    n: int = 10,
    n_perturb: int = 3,
    limit: int | None = None,
    device: str | torch.device = "cpu",
    log=print,
) -> dict[str, Path]:
    """Write every figure for `checkpoint` into `out_dir`; returns {name: path} of the files written.

    The test split is that of the data the checkpoint was trained on (its run's config.json, or a shipped card),
    unless `dataset` / `data_dir` name another. Examples are drawn from it with a generator seeded by `seed`: `n`
    for the reconstructions, `n_perturb` of those (of different classes where possible) for the perturbations, the
    first one for the routing figure. Figures that do not apply (no decoder, no summary.csv) are skipped with a
    note through `log`.
    """
    model = load_capsnet(checkpoint, device=device, any_model=True)
    run_dir = run_folder_of(checkpoint)
    data = checkpoint_data(model, [checkpoint], dataset=dataset, data_dir=data_dir)  # as `evaluate` reads it
    check_split(model, data.test, source=data.source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    idx = select_examples(data.test, n, seed=seed)
    images, labels = fit_to_model(data.test.images[idx], model.config), data.test.labels[idx]  # centre crops
    written: dict[str, Path] = {}
    if getattr(model, "decoder", None) is not None:
        written["reconstructions"] = plot_reconstructions(model, images, labels, out_dir / "reconstructions.png")
        pick = distinct_classes(labels, n_perturb)
        written["perturbation"] = plot_perturbation(model, images[pick], labels[pick], out_dir / "perturbation.png")
    else:
        log("note: the model has no decoder; skipped reconstructions.png and perturbation.png")
    if _forward(model, images[:1], return_coupling=True).coupling is not None:
        written["routing"] = plot_routing(model, images[0], int(labels[0]), out_dir / "routing.png")
    else:
        log(f"note: {type(model).__name__} has no routing weights; skipped routing.png")
    if run_dir is None:
        log(f"note: {checkpoint} is not a training run folder (no {SUMMARY_NAME}); skipped curves.png")
    else:
        try:
            written["curves"] = plot_curves(run_dir / SUMMARY_NAME, out_dir / "curves.png")
        except CheckpointError as e:
            log(f"note: skipped curves.png: {e}")
    cm = confusion_matrix(model, data.test, limit=limit)
    title = (
        f"Confusion matrix, {data.name} test split ({int(cm.sum())} images, accuracy "
        f"{float(cm.diagonal().sum()) / max(1, int(cm.sum())):.2%})"
    )
    written["confusion"] = plot_confusion(cm, out_dir / "confusion.png", title=title)
    return written
