"""Shared pieces of the figures: loading a checkpoint, choosing examples, and drawing helpers (matplotlib's
object-oriented API, imported lazily; PNGs written atomically without date metadata)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..data.split import Split
from ..errors import CapsNetError, CheckpointError, DatasetError
from ..fileio import atomic_open
from ..models.pretrained import load_pretrained
from ..models.recipe import model_input
from ..training.checkpoint import SUMMARY_NAME, resolve_checkpoint
from ..training.hardware import resolve_device

WRONG = "tab:red"
HIGHLIGHT = "tab:orange"


# ----------------------------------------------------------------------------------------------- inputs


def run_folder_of(path: str | os.PathLike) -> Path | None:
    """The training run folder behind a checkpoint argument (the folder holding summary.csv), or None."""
    p = Path(path).expanduser()
    for candidate in (p, p.parent if p.name in ("best", "last") else None):
        if candidate is not None and (candidate / SUMMARY_NAME).is_file():
            return candidate
    return None


def load_capsnet(path: str | os.PathLike, *, device: str | torch.device = "cpu", any_model: bool = False):
    """Load the CapsNet a checkpoint argument names (see `resolve_checkpoint`), in eval mode; with
    `any_model`, any registered model (EfficientCapsNet, the baseline CNN, ...)."""
    from ..models.capsnet import CapsNet

    folder = resolve_checkpoint(path)
    model = load_pretrained(folder, map_location=resolve_device(str(device)))
    if not any_model and not isinstance(model, CapsNet):
        raise CheckpointError(f"{folder}: holds a {type(model).__name__}; capsnet visualize needs a CapsNet")
    return model.eval()


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def select_examples(split: Split, n: int, *, seed: int = 0) -> torch.Tensor:
    """Indices of `n` examples of `split`, drawn without replacement by a generator seeded with `seed`."""
    if len(split) == 0:
        raise DatasetError("the split holds no images")
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(len(split), generator=g)[: max(1, min(n, len(split)))]


def distinct_classes(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of up to `k` entries of `labels`, preferring one per class, in order of first appearance."""
    seen: set[int] = set()
    first: list[int] = []
    rest: list[int] = []
    for pos, y in enumerate(labels.tolist()):
        (rest if y in seen else first).append(pos)
        seen.add(y)
    return torch.tensor((first + rest)[: max(1, k)], dtype=torch.long)


@torch.no_grad()
def _forward(model, images: torch.Tensor, *, return_coupling: bool = False):
    x = model_input(model, images.to(_model_device(model)))  # its input recipe (capsnet.models.recipe)
    try:
        return model(x, return_coupling=return_coupling)
    except ValueError as e:  # image shape does not match the model's config
        raise DatasetError(str(e)) from None


# ---------------------------------------------------------------------------------------------- drawing


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CapsNetError("capsnet visualize needs matplotlib: pip install 'capsnet[viz]'") from None
    return Figure(**kwargs)


def _save(fig, out: str | os.PathLike) -> Path:
    """Write `fig` as a PNG atomically; no Software/date metadata, so the bytes depend only on the content."""
    out = Path(out)
    with atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=100, metadata={"Software": None})
    return out


def _gray(ax, image: torch.Tensor) -> None:
    """Show a [C, H, W] image in [0, 1] without ticks: grey (C = 1), colour (C = 3), else the channels side by side
    in grey (smallNORB's stereo pair)."""
    img = image.detach().float().cpu().clamp(0, 1)
    if img.shape[0] not in (1, 3):
        img = torch.cat(list(img), dim=-1)[None]  # [1, H, C·W]
    if img.shape[0] == 1:
        ax.imshow(img[0].numpy(), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    else:
        ax.imshow(img.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def _mosaic(images: torch.Tensor, rows: int, cols: int, pad: int = 2) -> torch.Tensor:
    """Tile images [rows·cols, C, H, W] into one [C, rows·(H+pad)-pad, cols·(W+pad)-pad] image, gaps at 1."""
    c, h, w = images.shape[1:]
    canvas = torch.ones(c, rows * (h + pad) - pad, cols * (w + pad) - pad)
    for k, img in enumerate(images.detach().float().cpu().clamp(0, 1)):
        r, q = divmod(k, cols)
        canvas[:, r * (h + pad) : r * (h + pad) + h, q * (w + pad) : q * (w + pad) + w] = img
    return canvas


def _frame(ax, color: str, width: float = 3.0) -> None:
    for spine in ax.spines.values():
        spine.set_visible(True)
        spine.set_edgecolor(color)
        spine.set_linewidth(width)
