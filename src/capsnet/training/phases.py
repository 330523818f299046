"""The training step's named profiler ranges (loss, backward, optimizer, the model's parts), no-ops unless turned on.

The training step marks its phases with `phase` ranges; `profiled` turns them on and names the model's
forward passes by its top-level submodules (CapsNet: conv1 and primary → "conv", class_caps → "routing", decoder →
"decoder"), with forward hooks that exist only while a profile is taken. Outside `profiled` a range is a
shared no-op context (a flag test): the step costs what it did without them. The profile's analysis:
capsnet.tools.profiling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

MODEL_PHASES = {
    "conv1": "conv",
    "primary": "conv",
    "class_caps": "routing",
    "decoder": "decoder",
    "margin_loss": "loss",
}
STEP = "step"  # the range around one whole step (data included), set by profile_training
PHASES = ("data", "conv", "routing", "decoder", "loss", "optimizer")  # the report's order (others follow)
MODEL_OTHER = "forward (other)"  # the model's own operators outside its submodules (e.g. a ReLU between two)
BACKWARD = "backward"  # the range around zero_grad and backward(): its own work is "backward (other)"
_NULL = contextlib.nullcontext()
_active = False
LABELS: set[str] = {*PHASES, BACKWARD}  # every phase name used so far (the ranges summarize looks for)


def phase(name: str) -> contextlib.AbstractContextManager:
    """A `torch.profiler.record_function(name)` range while `profiled` is on; otherwise a no-op."""
    return torch.profiler.record_function(name) if _active else _NULL


@contextlib.contextmanager
def profiled(model: nn.Module, names: Mapping[str, str] = MODEL_PHASES) -> Iterator[None]:
    """Turn the step's `phase` ranges on and range each top-level submodule's forward pass as its phase
    (`names`, else the submodule's own name), and the rest of the model's forward as MODEL_OTHER, until the block
    ends."""
    global _active
    handles = []
    for child_name, child in [(MODEL_OTHER, model), *model.named_children()]:
        open_ranges: list[Any] = []
        label = names.get(child_name, child_name)
        LABELS.add(label)

        def enter(module, args, label=label, stack=open_ranges):
            stack.append(torch.profiler.record_function(label).__enter__())

        def leave(module, args, output, stack=open_ranges):
            stack.pop().__exit__(None, None, None)

        handles += [child.register_forward_pre_hook(enter), child.register_forward_hook(leave)]
    _active = True
    try:
        yield
    finally:
        _active = False
        for handle in handles:
            handle.remove()
