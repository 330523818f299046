"""Export a model for inference outside capsnet: ONNX (`.onnx`, run by onnxruntime and others) or torch.export
(`.pt2`, loaded by `torch.export.load`).

The exported graph maps raw uint8 images [B, C, H, W] (pixels 0..255, B dynamic, H x W the model's size before its
training crops) to the class-capsule lengths [B, n_classes] (the class probabilities the prediction is the argmax
of) and, for capsule models, the class capsules [B, n_classes, D]. The model's input recipe (capsnet.models.recipe:
centre crop, ÷ divisor or the training split's per-channel statistics) runs inside the graph; the ONNX file states
it in its metadata (`capsnet.input`).
Inside the export every routing layer takes its plain PyTorch path (`fast = False`, routing backend "torch"): the
C++ kernels and the fast paths' custom operators have no ONNX translation. The result is then checked against the
PyTorch model on a batch of another size (onnxruntime for ONNX), within `atol`.

ONNX export needs the `export` extra (onnx, onnxscript; onnxruntime for the check): pip install 'capsnet[export]'.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .._version import __version__
from ..config import to_dict
from ..errors import ConfigError, ExportError
from ..fileio import temporary_beside
from ..routing.backend import use_backend
from .inputs import image_hw
from .recipe import model_input, recipe_of

OPSET = 18  # the ONNX opset of the exported graph (onnxruntime >= 1.14 runs it)
MIN_OPSET = 13  # the oldest opset torch's exporter converts these models to (tested: 13 and 17 for the baseline)
FORMATS = {".onnx": "ONNX", ".pt2": "torch.export"}
ATOL = 1e-4  # the check's tolerance on every output, against the PyTorch model
OUTPUT_NAMES = ("lengths", "capsules")  # (a model without capsules, the baseline CNN, has the first only)


class ExportedOutputs(nn.Module):
    """`model` as the exported graph sees it: raw uint8 images -> its recipe -> (lengths,) or (lengths, capsules)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(model_input(self.model, images))
        return (out.lengths,) if out.capsules is None else (out.lengths, out.capsules)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode inside the block; in the mode it was in afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def reference_routing(model: nn.Module) -> Iterator[None]:
    """Every routing layer of `model` on its plain PyTorch path inside the block (`fast = False`, backend "torch");
    as before afterwards."""
    layers: list[Any] = [m for m in model.modules() if isinstance(getattr(m, "fast", None), bool)]
    saved = [m.fast for m in layers]
    try:
        for m in layers:
            m.fast = False
        with use_backend("torch", model=model):
            yield
    finally:
        for m, fast in zip(layers, saved):
            m.fast = fast


def example_images(model: nn.Module, batch: int, *, seed: int = 0) -> torch.Tensor:
    """Random raw uint8 images [batch, C, H, W] of the size the model reads (before its crops), on its device."""
    recipe, cfg = recipe_of(model), cast(Any, model.config)
    h, w = recipe.raw_size or image_hw(cfg.image_size)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, int(recipe.channels or cfg.in_channels), h, w)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(device)


def export_program(model: nn.Module) -> torch.export.ExportedProgram:
    """`model` (in eval mode, routing on its PyTorch path) as a torch.export program with a dynamic batch axis.
    A model that cannot be exported is an ExportError naming it and the first line of torch's reason."""
    batch = torch.export.Dim("batch", min=1)
    with evaluating(model), torch.no_grad(), reference_routing(model), _quiet():
        try:
            return torch.export.export(
                ExportedOutputs(model), (example_images(model, 2),), dynamic_shapes=({0: batch},), strict=False
            )
        except Exception as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ExportError(f"{type(model).__name__} cannot be exported ({type(e).__name__}: {reason})") from None


def export_model(
    model: nn.Module, path: str | os.PathLike, *, opset: int = OPSET, check: bool = True, atol: float = ATOL
) -> dict[str, Any]:
    """Write `model` to `path`: ONNX (`.onnx`, opset `opset`, one self-contained file) or torch.export (`.pt2`),
    atomically. With `check`, the file's outputs on 3 random images must match the model's within `atol`. The model
    is left as it was (its training mode and routing paths).

    Returns {"path", "format", "opset" (ONNX), "outputs": {name: shape}, "max_abs_diff" (with check)}."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ConfigError(f"{path}: give a .onnx or .pt2 file name")
    if path.suffix == ".onnx":
        _require_onnx(check)
        _check_opset(opset)
    program = export_program(model)
    names = list(OUTPUT_NAMES[: len(program.graph_signature.user_outputs)])
    info: dict[str, Any] = {"path": str(path), "format": FORMATS[path.suffix]}
    with temporary_beside(path, suffix=path.suffix) as tmp:  # (torch.export.save wants a .pt2 name)
        if path.suffix == ".onnx":
            _write_onnx(model, program, tmp, opset=opset, names=names)
            info["opset"] = opset
        else:
            torch.export.save(program, tmp)
        images = example_images(model, 3, seed=1)  # (the program was traced on 2)
        with evaluating(model), torch.no_grad():
            want = ExportedOutputs(model)(images)
        info["outputs"] = {n: ["batch", *t.shape[1:]] for n, t in zip(names, want, strict=True)}
        if check:
            got = _run_file(tmp, path.suffix, images)
            diff = max((g.cpu() - w.cpu()).abs().max().item() for g, w in zip(got, want, strict=True))
            if not diff <= atol:
                raise ExportError(f"{path}: the exported outputs differ from the model's by {diff:.3g} (> {atol:g})")
            info["max_abs_diff"] = diff
        os.replace(tmp, path)
    return info


def _require_onnx(check: bool) -> None:
    """ExportError naming the extra unless torch's ONNX exporter (onnx, onnxscript) and, to `check`, onnxruntime
    can be imported."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        raise ExportError("ONNX export needs onnx and onnxscript: pip install 'capsnet[export]'") from None
    if check:
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            raise ExportError(
                "checking the ONNX file needs onnxruntime: pip install 'capsnet[export]' (or pass --no-check)"
            ) from None


def _check_opset(opset: int) -> None:
    """ConfigError unless `opset` is one the installed onnx can convert to (MIN_OPSET to its newest)."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise ConfigError(f"opset {opset}: the installed onnx writes opsets {MIN_OPSET} to {newest}")


def _write_onnx(model: nn.Module, program: torch.export.ExportedProgram, path: Path, *, opset: int, names) -> None:
    with _quiet():
        try:
            onnx_program = torch.onnx.export(
                program, f=None, input_names=["images"], output_names=names, opset_version=opset, verbose=False
            )
        except RuntimeError as e:  # (the version converter: an operator with no form in that opset)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ExportError(f"{type(model).__name__} cannot be written in ONNX opset {opset} ({reason})") from None
    assert onnx_program is not None  # f=None: the program is returned, not written
    cfg: Any = model.config
    onnx_program.model.metadata_props.update(
        {
            "capsnet.version": __version__,
            "capsnet.model_type": str(getattr(model, "model_type", type(model).__name__)),
            "capsnet.config": json.dumps(to_dict(cfg)),
            "capsnet.outputs": ", ".join(names),
            "capsnet.input": input_note(model),
        }
    )
    onnx_program.save(str(path), external_data=False)
    _name_batch_axis(path)


def _name_batch_axis(path: Path) -> None:
    """Name the dynamic first axis of the file's inputs and outputs `batch` (the exporter writes a symbol such as
    `s34`), wherever that symbol appears."""
    import onnx

    proto = onnx.load(str(path))
    graph = proto.graph
    symbols = {v.type.tensor_type.shape.dim[0].dim_param for v in graph.input if v.type.tensor_type.shape.dim}
    symbols.discard("")
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in symbols:
                dim.dim_param = "batch"
    onnx.save(proto, str(path))


def input_note(model: nn.Module) -> str:
    """What the exported graph takes and does with it, in words (the ONNX file's `capsnet.input`)."""
    recipe = recipe_of(model)
    h, w = recipe.raw_size or image_hw(cast(Any, model.config).image_size)
    values = recipe.describe()
    if recipe.channel_standardize:
        values = "(p - mean_c) / std_c with the training split's per-channel mean and std (config channel_mean/std)"
    crop = f", centre-cropped to {'x'.join(map(str, recipe.size))}" if recipe.size and recipe.size != (h, w) else ""
    note = f"images: uint8 pixels p in 0..255 [B, {recipe.channels}, {h}, {w}]; inside the graph{crop}, {values}"
    if recipe.digits:  # the conversion capsnet predict applies to image files, outside the graph
        note += "; a photo of a digit goes in MNIST's form first (LeCun et al.'s procedure: docs/inputs.md)"
    return note


def _run_file(path: Path, suffix: str, images: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of the exported file at `path` on `images`."""
    if suffix == ".pt2":
        with torch.no_grad():
            return list(torch.export.load(path).module()(images))
    import onnxruntime  # (checked by _require_onnx)

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [torch.from_numpy(x) for x in session.run(None, {"images": images.cpu().numpy()})]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export's and torch.onnx's own deprecation warnings and log lines (not about the model) held back."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            for lg in loggers:
                lg.setLevel(logging.ERROR)
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


__all__ = ["ATOL", "FORMATS", "OPSET", "OUTPUT_NAMES", "export_model", "export_program", "reference_routing"]
