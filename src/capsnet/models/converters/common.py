"""What every PyTorch-state-dict converter shares: reading the file safely, and checking each tensor it takes.

A converter reads another implementation's saved weights (a `torch.save` of a `state_dict`, or of a dict holding
one), checks every tensor's name and shape against what that implementation builds, rearranges them into a capsnet
model and loads them strictly. A bad file is one `capsnet.errors.CheckpointError` line naming the key.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ...errors import CheckpointError

# Keys under which training scripts nest their state dict (e.g. `torch.save({"net": net.state_dict(), ...})`).
NESTED_KEYS = ("state_dict", "net", "model", "model_state_dict")


def add_routing_iterations(parser: argparse.ArgumentParser, default: int) -> None:
    """`--routing-iterations`: the iterations of the source's routing, which its weights do not record."""
    parser.add_argument(
        "--routing-iterations",
        type=int,
        default=default,
        metavar="R",
        help=f"routing iterations of the source network (default: {default})",
    )


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a PyTorch checkpoint, read with `torch.load(weights_only=True)` (no arbitrary pickle).

    Accepts a state dict, or a dict holding one under a key of NESTED_KEYS; a `module.` prefix (DataParallel) is
    dropped. Anything else is a CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    with open(path, "rb"):  # (no permission: the OSError naming the path)
        pass
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as e:  # the weights-only unpickler on foreign bytes raises many types (IndexError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a PyTorch checkpoint that loads with weights_only=True ({first})") from None
    if isinstance(obj, Mapping):
        nested = [k for k in NESTED_KEYS if isinstance(obj.get(k), Mapping)]
        if nested:
            obj = obj[nested[0]]
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(k, str) for k in obj):
        raise CheckpointError(f"{path}: not a state dict (expected a mapping of tensor names to tensors)")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: not a state dict: {bad[0]!r} is a {type(obj[bad[0]]).__name__}, not a tensor")
    state = dict(obj)
    if all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


class Tensors:
    """The tensors of one file, taken one by one with their expected shapes; `finish()` rejects any left over."""

    def __init__(self, state: dict[str, torch.Tensor], path: str | os.PathLike, fmt: str):
        self.state, self.path, self.fmt = state, path, fmt
        self.taken: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.state

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of `key`, which must exist."""
        return tuple(self.take_any(key, record=False).shape)

    def take_any(self, key: str, *, ndim: int | None = None, record: bool = True) -> torch.Tensor:
        """Tensor `key` of any shape (of `ndim` dimensions if given)."""
        if key not in self.state:
            raise CheckpointError(f"{self.path}: missing tensor {key!r} (not a {self.fmt} state dict?)")
        t = self.state[key]
        if ndim is not None and t.dim() != ndim:
            raise CheckpointError(f"{self.path}: tensor {key!r} has shape {list(t.shape)}, expected {ndim} dimensions")
        if record:
            self.taken.add(key)
        return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32)

    def take(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `key`, which must have exactly `shape`."""
        t = self.take_any(key)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def take_batchnorm(self, prefix: str, channels: int) -> dict[str, torch.Tensor]:
        """A BatchNorm's weight, bias, running_mean, running_var (and num_batches_tracked when saved)."""
        out = {
            name: self.take(f"{prefix}.{name}", (channels,))
            for name in ("weight", "bias", "running_mean", "running_var")
        }
        tracked = f"{prefix}.num_batches_tracked"
        out["num_batches_tracked"] = self.state[tracked].long() if tracked in self.state else torch.tensor(0)
        self.taken.add(tracked)
        return out

    def finish(self) -> None:
        left = sorted(set(self.state) - self.taken)
        if left:
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            raise CheckpointError(f"{self.path}: unexpected tensor {left[0]!r}{more} for a {self.fmt} state dict")


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Load the converted tensors strictly (every parameter and buffer given, nothing extra)."""
    own = model.state_dict()
    state = {k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # a converter bug, not the file's; still one line
        raise CheckpointError(f"{path}: converted weights do not fit the model ({str(e).splitlines()[0]})") from None
    model.eval()


def decoder_state(t: Tensors, sizes: list[int], prefix: str = "decoder") -> dict[str, torch.Tensor]:
    """A reconstruction decoder saved as `nn.Sequential(Linear, ReLU, Linear, ReLU, Linear, Sigmoid)` under `prefix`
    (layers 0, 2, 4) -> capsnet's CapsuleDecoder (`decoder.net.0/2/4`). `sizes`: [n·d, hidden..., pixels]."""
    state = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        state[f"decoder.net.{2 * i}.weight"] = t.take(f"{prefix}.{2 * i}.weight", (b, a))
        state[f"decoder.net.{2 * i}.bias"] = t.take(f"{prefix}.{2 * i}.bias", (b,))
    return state
