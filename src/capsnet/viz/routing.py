"""The routing figure: where each input capsule sends its output, for every routing method."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..errors import CapsNetError
from ..pixels import to_float
from .common import HIGHLIGHT, WRONG, _figure, _forward, _frame, _gray, _save


def routing_maps(coupling: torch.Tensor, n_types: int, grid: int) -> torch.Tensor:
    """Coupling coefficients c [n_primary, n_classes] (primary index type-major: type·grid² + row·grid + col)
    averaged over the capsule types: [n_classes, grid, grid]."""
    c = coupling.detach().float().cpu().view(n_types, grid, grid, -1)
    return c.mean(dim=0).permute(2, 0, 1)


def routing_method(model) -> str:
    """The routing a model's class capsules use: CapsNet's `config.routing`, else the class's `routing_method`."""
    return str(getattr(model.config, "routing", None) or getattr(model, "routing_method", "routing"))


def plot_routing(model, image: torch.Tensor, label: int | None, out: str | os.PathLike) -> Path:
    """Coupling coefficients c_ij for one image [C, H, W]: for each digit capsule j, a grid×grid map of the
    mean over the primary capsule types of c_ij at each location; shared colour scale, prediction framed.
    Models whose routing weights are not over CapsNet's primary capsule grid get `plot_routing_weights`."""
    cfg = model.config
    o = _forward(model, image.unsqueeze(0), return_coupling=True)
    if o.coupling is None:
        raise CapsNetError(f"{type(model).__name__} has no routing weights to draw")
    grid = getattr(cfg, "primary_grid", None)
    if grid is None or o.coupling.shape[1] != getattr(cfg, "primary_types", 0) * grid**2:
        return plot_routing_weights(model, image, label, out, o)
    maps = routing_maps(o.coupling[0], cfg.primary_types, cfg.primary_grid)
    lengths, pred = o.lengths[0].cpu(), int(o.predictions[0])
    n_classes = maps.shape[0]
    cols = math.ceil(n_classes / 2)
    fig = _figure(figsize=(2.9 + 1.75 * cols, 4.4), layout="constrained")
    gs = fig.add_gridspec(2, cols + 2, width_ratios=[2.0, *([1.0] * cols), 0.09])
    ax_img = fig.add_subplot(gs[:, 0])
    _gray(ax_img, to_float(image.cpu()))
    truth = "" if label is None else f"true {int(label)}, "
    ax_img.set_title(
        f"input\n({truth}predicted {pred})",
        fontsize=10,
        color=WRONG if label is not None and int(label) != pred else "black",
    )
    vmin, vmax = float(maps.min()), float(maps.max())
    if vmax - vmin < 1e-6:
        vmin, vmax = vmin - 1e-3, vmax + 1e-3
    im = None
    for j in range(n_classes):
        ax = fig.add_subplot(gs[j // cols, 1 + j % cols])
        im = ax.imshow(maps[j].numpy(), cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        is_pred = j == pred
        ax.set_title(
            f"{'▶ ' if is_pred else ''}digit {j}\n|v|={float(lengths[j]):.2f}",
            fontsize=9,
            color=HIGHLIGHT if is_pred else "black",
            fontweight="bold" if is_pred else "normal",
        )
        if is_pred:
            _frame(ax, HIGHLIGHT, 3.5)
    cax = fig.add_subplot(gs[:, -1])
    cb = fig.colorbar(im, cax=cax)
    span = vmax - vmin
    digits = max(2, min(8, 1 - math.floor(math.log10(span / 4))))
    cb.ax.yaxis.set_major_formatter(f"{{x:.{digits}f}}")
    cb.set_label(f"mean c_ij over the {cfg.primary_types} primary capsule types", fontsize=9)
    cb.ax.tick_params(labelsize=8)
    method = routing_method(model)
    when = f"after {cfg.routing_iterations} iterations" if method in ("dynamic", "inverted-attention") else "one pass"
    fig.suptitle(
        f"Routing ({method}): weights of the {cfg.primary_grid}×{cfg.primary_grid} primary capsule "
        f"locations to each digit capsule ({when})",
        fontsize=11,
    )
    return _save(fig, out)


def plot_routing_weights(model, image: torch.Tensor, label: int | None, out: str | os.PathLike, o=None) -> Path:
    """Routing weights w_ij [n_in, n_out] of a model's class capsule layer for one image, as a heat map (children
    i down, parents j across, prediction framed), beside the mean weight each parent receives; 1/n_out, uniform
    routing, is marked."""
    o = o if o is not None else _forward(model, image.unsqueeze(0), return_coupling=True)
    w = o.coupling[0].detach().float().cpu()  # [n_in, n_out]
    n_in, n_out = w.shape
    pred = int(o.predictions[0])
    fig = _figure(figsize=(11, 4.6), layout="constrained")
    ax_img, ax_w, ax_mean = fig.subplots(1, 3, width_ratios=[1.0, 2.2, 1.6])
    _gray(ax_img, to_float(image.cpu()))
    truth = "" if label is None else f"true {int(label)}, "
    ax_img.set_title(
        f"input\n({truth}predicted {pred})",
        fontsize=10,
        color=WRONG if label is not None and int(label) != pred else "black",
    )
    im = ax_w.imshow(w.numpy(), cmap="viridis", aspect="auto", interpolation="nearest")
    ax_w.set_xlabel("class capsule j")
    ax_w.set_ylabel(f"input capsule i ({n_in})")
    ax_w.set_xticks(range(n_out))
    ax_w.add_patch(_rectangle(pred - 0.5, -0.5, 1, n_in))
    fig.colorbar(im, ax=ax_w, fraction=0.05).set_label("w_ij (sums to 1 over j)", fontsize=9)
    mean = w.mean(dim=0)
    ax_mean.bar(range(n_out), mean.numpy(), color=[HIGHLIGHT if j == pred else "tab:blue" for j in range(n_out)])
    ax_mean.axhline(1.0 / n_out, color="gray", linestyle="--", linewidth=1, label="uniform 1/n")
    ax_mean.set_xticks(range(n_out))
    ax_mean.set_xlabel("class capsule j")
    ax_mean.set_title("mean over inputs; class outputs on top", fontsize=10)
    for j, value in enumerate(o.lengths[0].float().cpu().tolist()):  # activations a_j or lengths |v_j|
        ax_mean.annotate(f"{value:.2f}", (j, float(mean[j])), ha="center", va="bottom", fontsize=7)
    ax_mean.legend(fontsize=8)
    spread = float((w - 1.0 / n_out).abs().amax(dim=1).mean() * n_out)
    fig.suptitle(
        f"Routing ({routing_method(model)}, {type(model).__name__}): weights of the {n_in} input capsules "
        f"to the {n_out} class capsules; mean max |w − 1/n| = {spread:.2f} × 1/n",
        fontsize=11,
    )
    return _save(fig, out)


def _rectangle(x: float, y: float, width: float, height: float):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, fill=False, edgecolor=HIGHLIGHT, linewidth=2.5)
