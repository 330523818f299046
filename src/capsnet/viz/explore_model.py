"""What `capsnet explore` computes, without the web page: one image through a model, its class capsules, the
decoder on a tweaked capsule (the paper's Fig. 4) and the routing weights at each iteration. Pure torch; the page
(`capsnet.viz.explore`) only lays these out.

Every input goes through `model_input`, the conversion `capsnet predict` applies to an image file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.images import check_pixels
from ..errors import DatasetError
from ..inference import class_name, preprocess
from ..limits import MAX_UPLOAD_BYTES as MAX_UPLOAD_BYTES
from ..models.inputs import image_hw

# Uploads the page accepts: at most this many bytes per file, and this many pixels once decoded (a decompression
# bomb is refused from its header, before its pixels are read).
POSE_RANGE = 0.25  # Fig. 4: each dimension tweaked by offsets in [−0.25, 0.25]


@dataclass
class Features:
    """What the page shows of a model, and why it hides the rest (`hidden`: one sentence per hidden panel)."""

    decoder: bool
    pose_dim: int  # class capsule dimensions (0: the model's class outputs are scores, not pose vectors)
    routing: str  # "grid" (a map over the input capsule grid), "list" (weights per input capsule) or ""
    iterations: int  # routing iterations the slider offers (1: no slider)
    branches: int  # HVC: branches whose capsule lengths are shown (0: none)
    matrix_pose: bool  # EM: class poses are 4×4 matrices, shown with the activations
    hidden: list[str] = field(default_factory=list)


@dataclass
class Analysis:
    """One image through the model: its input x [1, C, H, W], class capsules v [1, n, d] (None for a CNN),
    lengths / activations [n], the prediction, and the routing weights of the class layer [n_in, n] (or None)."""

    x: torch.Tensor
    capsules: torch.Tensor | None
    lengths: torch.Tensor
    prediction: int
    coupling: torch.Tensor | None
    branch_lengths: torch.Tensor | None
    routing_call: tuple[tuple, dict] | None  # the class layer's inputs, to replay its routing at iteration t


def model_input(model: Any, path: str | os.PathLike) -> torch.Tensor:
    """An image file as the model's input batch [1, C, H, W]: `capsnet predict`'s conversion (the model's input
    recipe), after the upload limits."""
    check_upload(path)
    return preprocess(model, [Path(path)])


def check_upload(path: str | os.PathLike) -> None:
    """DatasetError for a file over MAX_UPLOAD_BYTES, not an image, or of more pixels than `capsnet predict` decodes
    (MAX_IMAGE_PIXELS, read from its header, so a decompression bomb is never decoded)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p.name}: no such image file")
    if p.stat().st_size > MAX_UPLOAD_BYTES:
        raise DatasetError(f"{p.name}: larger than {MAX_UPLOAD_BYTES // 2**20} MiB")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(p) as im:
            width, height = im.size
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError):
        raise DatasetError(f"{p.name}: not a PNG, JPEG or other readable image") from None
    check_pixels(p.name, (width, height))


def class_names(model: Any) -> list[str]:
    cfg = model.config
    return [class_name(cfg, k) for k in range(cfg.n_classes)]


def features(model: Any) -> Features:
    """Which panels apply to `model`, found by running it once on a blank input."""
    a = analyse(model, torch.zeros(1, *input_shape(model), device=next(model.parameters()).device))
    name = type(model).__name__
    decoder = getattr(model, "decoder", None) is not None
    pose_dim = 0 if a.capsules is None or a.capsules.shape[-1] < 2 else int(a.capsules.shape[-1])
    routing = "" if a.coupling is None else ("grid" if routing_grid(model, a.coupling.shape[0]) else "list")
    layer = replayable_layer(model)
    iterations = int(layer.iterations) if layer is not None and a.routing_call is not None else 1
    branches = 0 if a.branch_lengths is None else int(a.branch_lengths.shape[-1])
    f = Features(decoder, pose_dim, routing, iterations, branches, matrix_pose=hasattr(model, "classes"))
    if not decoder:
        f.hidden.append(
            f"Reconstruction and pose sliders: {name} has no decoder to reconstruct the image from a class capsule."
        )
    if pose_dim == 0:
        f.hidden.append(f"Class capsule poses: {name}'s class outputs are scores, not pose vectors.")
    if not routing:
        f.hidden.append(f"Routing: {name} has no routing weights into its class outputs.")
    elif routing == "list" and a.coupling is not None:
        f.hidden.append(
            f"Routing grid: {name}'s class layer reads {a.coupling.shape[0]} input capsules that form "
            "no spatial grid; their weights are shown as a strip."
        )
    if routing and iterations == 1:
        why = "routes in one pass" if layer is None or a.routing_call is None else "was built with one iteration"
        if f.matrix_pose:
            why = "runs EM inside each capsule layer, which keeps only its final assignments R_ij"
        elif name == "InvertedAttentionCapsNet":
            why = "routes all its capsule layers together, so one layer's iterations cannot be replayed alone"
        f.hidden.append(f"Routing iteration slider: {name} {why}; the final weights are shown.")
    return f


def input_shape(model: Any) -> tuple[int, int, int]:
    cfg = model.config
    return (cfg.in_channels, *image_hw(cfg.image_size))


def replayable_layer(model: Any) -> Any:
    """The class capsule layer whose routing can be rerun with fewer iterations (dynamic routing, a single
    inverted-attention layer), or None."""
    layer = getattr(model, "class_caps", None)
    return layer if isinstance(getattr(layer, "iterations", None), int) else None


@torch.no_grad()
def analyse(model: Any, x: torch.Tensor) -> Analysis:
    """Run `model` on x [1, C, H, W] (eval mode) with the coupling coefficients, recording the class layer's inputs."""
    model.eval()
    layer = replayable_layer(model)
    calls: list[tuple[tuple, dict]] = []
    handle = None
    if layer is not None:
        handle = layer.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        try:
            out = model(x, return_coupling=True)
        except TypeError:  # a model without routing weights (the baseline CNN, HVC)
            out = model(x)
    except ValueError as e:  # the image does not fit the model's input
        raise DatasetError(str(e)) from None
    finally:
        if handle is not None:
            handle.remove()
    coupling = getattr(out, "coupling", None)
    branch = getattr(out, "branch_lengths", None)
    return Analysis(
        x=x,
        capsules=None if out.capsules is None else out.capsules.detach(),
        lengths=out.lengths[0].detach().float().cpu(),
        prediction=int(out.predictions[0]),
        coupling=None if coupling is None else coupling[0].detach().float().cpu(),
        branch_lengths=None if branch is None else branch[0].detach().float().cpu(),
        routing_call=calls[-1] if len(calls) == 1 else None,
    )


def tweaked_capsules(capsules: torch.Tensor, j: int, offsets: list[float] | torch.Tensor) -> torch.Tensor:
    """v with Fig. 4's perturbation of class capsule j: v_j[d] + offset_d for each dimension d  [1, n, D]."""
    v = capsules.clone()
    v[0, j] += torch.as_tensor(offsets, dtype=v.dtype, device=v.device)
    return v


@torch.no_grad()
def reconstruct(model: Any, a: Analysis, j: int, offsets: list[float] | torch.Tensor) -> torch.Tensor:
    """The decoder's image [C, H, W] from class capsule j of `a`, each dimension moved by its offset (the others
    masked, as in training)."""
    if a.capsules is None or getattr(model, "decoder", None) is None:
        raise DatasetError(f"{type(model).__name__} has no decoder")
    v = tweaked_capsules(a.capsules, j, offsets)
    return model.decoder(v, torch.tensor([j], device=v.device))[0].float().cpu()


@torch.no_grad()
def coupling_at(model: Any, a: Analysis, iteration: int) -> torch.Tensor:
    """The class layer's weights c_ij [n_in, n] after `iteration` routing iterations (the final ones when the
    layer cannot be replayed): the same layer rerun on the same inputs with that many iterations."""
    if a.coupling is None:
        raise DatasetError(f"{type(model).__name__} has no routing weights")
    layer = replayable_layer(model)
    if layer is None or a.routing_call is None or iteration >= layer.iterations:
        return a.coupling
    args, kwargs = a.routing_call
    kept = layer.iterations
    layer.iterations = max(1, int(iteration))
    try:
        out = layer(*args, **{**kwargs, "return_weights": True})
    finally:
        layer.iterations = kept
    return out[1][0].detach().float().cpu()


def routing_grid(model: Any, n_in: int) -> tuple[int, int, int] | None:
    """(types, height, width) of the capsule grid the class layer reads (index type-major: type·H·W + row·W + col),
    when its `n_in` input capsules form one; else None."""
    cfg = model.config
    candidates = []
    if hasattr(cfg, "primary_hw"):
        candidates.append((cfg.primary_types, *cfg.primary_hw))
    if hasattr(cfg, "class_grid"):  # EM: the last convolutional capsule layer
        candidates.append((cfg.caps2_types, cfg.class_grid, cfg.class_grid))
    if getattr(cfg, "capsule_types", None) and hasattr(cfg, "grids"):
        candidates.append((cfg.capsule_types[-1], cfg.grids[-1], cfg.grids[-1]))
    for types, h, w in candidates:
        if types * h * w == n_in and h * w > 1:
            return int(types), int(h), int(w)
    return None


def routing_map(model: Any, coupling: torch.Tensor, j: int) -> torch.Tensor:
    """The weights to class j as viz/routing's figure draws them: over the capsule grid, the mean over the
    capsule types of c_ij  [H, W]; without a grid, one row of c_ij per input capsule  [1, n_in]."""
    grid = routing_grid(model, coupling.shape[0])
    if grid is None:
        return coupling[:, j][None]
    types, h, w = grid
    return coupling.view(types, h, w, -1).mean(dim=0)[..., j]


def heatmap_rgb(values: torch.Tensor, *, scale: int = 24) -> torch.Tensor:
    """A 2-D map as a viridis RGB image [h·scale, w·scale, 3] (uint8), its own min to max (a flat map: mid-scale)."""
    from matplotlib import colormaps

    v = values.detach().float().cpu()
    lo, hi = float(v.min()), float(v.max())
    norm = (v - lo) / (hi - lo) if hi - lo > 1e-12 else torch.full_like(v, 0.5)
    rgb = torch.from_numpy(colormaps["viridis"](norm.numpy())[..., :3]).float()
    if v.shape[0] == 1:  # a strip: keep it readable
        scale = max(4, min(scale, 600 // max(1, v.shape[1])))
    return _enlarge((rgb * 255).round().to(torch.uint8), scale)


def image_rgb(image: torch.Tensor, *, scale: int = 6) -> torch.Tensor:
    """An image [C, H, W] (values clamped to [0, 1]) as uint8 [H·scale, W·scale, 3], nearest-neighbour enlarged;
    two channels (smallNORB's stereo pair) side by side."""
    img = image.detach().float().cpu().clamp(0, 1)
    if img.shape[0] not in (1, 3):
        img = torch.cat(list(img), dim=-1)[None]
    if img.shape[0] == 1:
        img = img.expand(3, -1, -1)
    return _enlarge((img.permute(1, 2, 0) * 255).round().to(torch.uint8), scale)


def _enlarge(rgb: torch.Tensor, scale: int) -> torch.Tensor:
    """[h, w, 3] uint8 -> [h·scale, w·scale, 3], each pixel a scale×scale block (numpy: no thread pool to wake,
    which under a loaded CPU costs more than the copy)."""
    return torch.from_numpy(rgb.numpy().repeat(scale, axis=0).repeat(scale, axis=1))


def pose_side(pose_dim: int) -> int:
    """The side of a square pose matrix (EM's 4×4), else 0."""
    side = math.isqrt(pose_dim)
    return side if side * side == pose_dim and side > 1 else 0
