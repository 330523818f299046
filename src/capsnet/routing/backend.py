"""Which implementation the routing layers run: capsnet's C++ CPU kernels, or PyTorch's own ops.

- ``"auto"`` (the default): a layer's C++ kernel on CPU tensors once it is built (``capsnet build-kernels``; never
  compiled by a forward: until then one log line and PyTorch), PyTorch elsewhere. With ``CAPSNET_NO_EXT=1`` in the
  environment, ``"auto"`` means ``"torch"``.
- ``"cpp"``: the C++ kernels on CPU tensors (built at first use if the cache lacks them), and a kernel that cannot
  be built (or is disabled by ``CAPSNET_NO_EXT``) is an error rather than a fallback. Tensors on other devices use
  PyTorch: the kernels are CPU-only.
- ``"torch"``: never build or run a C++ kernel. The layers run their PyTorch fast paths (same results, hand-derived
  backward passes); ``layer.fast = False`` selects their plain autograd path instead (double backward, export).
- ``"triton"``: dynamic routing on CUDA tensors by Triton kernels (:mod:`capsnet.routing.dynamic_triton`; an error
  if Triton cannot be imported); otherwise as "auto". Under "auto", CUDA tensors take the Triton kernels only with
  ``CAPSNET_TRITON=1`` in the environment, until they are measured faster than the PyTorch path.

The choice is global (:func:`set_backend`, or :func:`use_backend` for a block), or per layer or model: a layer's
`backend` attribute (None follows the global choice), which ``set_backend(name, model=m)`` sets on every routing
layer of `m`. Under torch.compile the choice is read once, when the graph is traced.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError

BACKENDS = ("auto", "cpp", "torch", "triton")
_BACKEND = {"global": "auto"}


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"unknown routing backend {name!r}; known: {', '.join(BACKENDS)}")
    return name


class KernelLayer:
    """Mixed into the routing layers that have a C++ kernel: their `backend` ("auto", "cpp", "torch" or None, the
    global choice)."""

    _backend: str | None = None

    @property
    def backend(self) -> str | None:
        return self._backend

    @backend.setter
    def backend(self, name: str | None) -> None:
        self._backend = None if name is None else _check(name)


def get_backend() -> str:
    """The global choice: "auto", "cpp" or "torch"."""
    return _BACKEND["global"]


def set_backend(name: str, *, model: Any = None) -> None:
    """Choose the routing backend: globally, or with `model` (an nn.Module) for each of its routing layers."""
    _check(name)
    if model is None:
        _BACKEND["global"] = name
        return
    for layer in kernel_layers(model):
        layer.backend = name


def kernel_layers(model: Any) -> list[KernelLayer]:
    """The routing layers of `model` that have a C++ kernel."""
    return [m for m in model.modules() if isinstance(m, KernelLayer)]


@contextmanager
def use_backend(name: str, *, model: Any = None) -> Iterator[None]:
    """`set_backend(name, model=model)` inside the `with` block; the previous choice (global or per layer) after."""
    _check(name)
    if model is None:
        previous = get_backend()
        set_backend(name)
        try:
            yield
        finally:
            set_backend(previous)
        return
    layers = kernel_layers(model)
    saved = [layer.backend for layer in layers]
    try:
        for layer in layers:
            layer.backend = name
        yield
    finally:
        for layer, value in zip(layers, saved):
            layer.backend = value


def resolve(layer_backend: str | None = None) -> str:
    """What a layer with `backend` = `layer_backend` runs: its own choice, else the global one; "auto" is "torch"
    when CAPSNET_NO_EXT is set."""
    name = layer_backend if layer_backend is not None else get_backend()
    if name == "auto" and os.environ.get("CAPSNET_NO_EXT", "") not in ("", "0"):
        return "torch"
    return name


__all__ = ["BACKENDS", "KernelLayer", "get_backend", "kernel_layers", "resolve", "set_backend", "use_backend"]
