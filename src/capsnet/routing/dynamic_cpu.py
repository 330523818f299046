"""Dynamic routing (Procedure 1) as one fused C++ kernel on CPUs, forward and backward.

The kernel (``csrc/routing_cpu.cpp``) works one sample at a time, in parallel over the batch: a sample's votes
û_j|i = W_ijᵀ u_i [in, out, out_d] (737 KB fp32 for MNIST) stay in the L2 cache while all r routing passes run
on them, so routing costs a few MFLOP per sample instead of a sequence of memory-bound tensor ops. The backward
pass is the hand derivation of :class:`capsnet.routing.FastRouting`: per sample it recomputes û and walks the
passes backwards, keeping only small factors (G_t = dL/db_t [in, out], ds_t, v_t [out, out_d]); then, in
parallel over the input capsules, it rebuilds dL/dû from them and forms dL/du and dL/dW, summing over the batch in
a fixed order (so dL/dW does not depend on the number of threads).

The extension is compiled with ``torch.utils.cpp_extension.load_inline`` at first use (``-O3 -march=native
-fopenmp``, or without ``-march=native`` if that fails; needs a C++ compiler and ninja) and cached in torch's
extension directory. If it cannot be built, :func:`available` is False and :class:`capsnet.Router` uses
:func:`capsnet.routing.fast_dynamic_routing` (with one warning). ``CAPSNET_NO_EXT=1`` disables the extension.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).with_name("csrc") / "routing_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the loaded extension or None after a failure; "error": why


def _ensure_ninja_on_path() -> None:
    """torch's cpp_extension runs `ninja` from PATH; the `ninja` pip package may sit in an inactive venv."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package ships the binary in ninja.BIN_DIR
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags (what -march=native depends on)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = {line for line in f if line.startswith(("model name", "flags", "Features"))}
    except OSError:
        lines = set()
    return "".join(sorted(lines)) or platform.processor() or platform.machine()


def _build(verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    _ensure_ninja_on_path()
    source = _SOURCE.read_text()
    errors = []
    # -march=native builds are named after this CPU model, so a cache shared between machines cannot hand one
    # CPU code built for another.
    cpu = hashlib.sha1(_cpu_model().encode()).hexdigest()[:10]
    variants = (
        (f"capsnet_routing_cpu_{cpu}", ["-O3", "-march=native", "-mprefer-vector-width=512"]),
        ("capsnet_routing_cpu_generic", ["-O3"]),
    )
    for name, flags in variants:
        try:
            return load_inline(
                name=name,
                cpp_sources=[source],
                extra_cflags=[*flags, "-fopenmp", "-std=c++17"],
                extra_ldflags=["-fopenmp"],
                verbose=verbose,
            )
        except Exception as e:  # compiler/flag/ninja problems: try the next flags, then give up
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise RuntimeError("; ".join(errors))


def load(verbose: bool = False, *, raise_errors: bool = False) -> ModuleType | None:
    """The compiled extension, building it on the first call (thread-safe); None if disabled or unbuildable."""
    if os.environ.get("CAPSNET_NO_EXT", "") not in ("", "0"):
        return None
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                try:
                    _state["module"] = _build(verbose)
                except Exception as e:
                    _state["module"], _state["error"] = None, f"{type(e).__name__}: {e}"
                    if not raise_errors:
                        warnings.warn(
                            "capsnet: the fused CPU routing kernel could not be built; using the PyTorch-op fast "
                            f"path instead ({str(e)[:300]})",
                            RuntimeWarning,
                            stacklevel=3,
                        )
    if _state["module"] is None and raise_errors:
        raise RuntimeError(f"capsnet: cannot build the CPU routing kernel: {_state.get('error')}")
    return _state["module"]  # type: ignore[return-value]


def _kernel() -> ModuleType:
    """The loaded extension; a build failure raises (as `load(raise_errors=True)`)."""
    module = load(raise_errors=True)
    if module is None:  # CAPSNET_NO_EXT: callers check `load()` first, so this is a bug if it happens
        raise RuntimeError("capsnet: the CPU routing kernel is disabled (CAPSNET_NO_EXT)")
    return module


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the fused kernel can be used (builds it on the first call). torch.compile takes the answer as a
    constant, so the lock and the build stay out of the traced graph."""
    return load() is not None


def applicable(u: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`cpu_dynamic_routing` handles these inputs: CPU tensors, the kernel builds."""
    return u.device.type == "cpu" and weight.device.type == "cpu" and available()


# ------------------------------------------------------------------------------------------------ custom ops
# The kernel's forward and backward are the operators `capsnet::routing_cpu` and `capsnet::routing_cpu_backward`
# (CPU only), so torch.compile keeps each as one node; see capsnet.routing.dynamic_fast for the conventions.


@torch.library.custom_op("capsnet::routing_cpu", mutates_args=(), device_types="cpu")
def _routing_cpu_op(
    u: torch.Tensor, weight: torch.Tensor, iterations: int, detach_votes: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(v [B, out, out_d], c [B, in, out], c_all [r-1, B, in, out], s_all [B, r, out, out_d], and private
    contiguous copies of u and W for the backward pass); detach_votes matters to the backward pass only."""
    u_c = torch.empty_like(u, memory_format=torch.contiguous_format).copy_(u)
    w_c = torch.empty_like(weight, memory_format=torch.contiguous_format).copy_(weight)
    v, c_all, s_all = _kernel().forward(u_c, w_c, iterations)
    if iterations > 1:
        c = c_all[-1].clone()
    else:  # the single pass couples uniformly
        c = u.new_full((u.shape[0], weight.shape[0], weight.shape[1]), 1.0 / weight.shape[1])
    return v, c, c_all, s_all, u_c, w_c


@_routing_cpu_op.register_fake
def _(u, weight, iterations, detach_votes):
    batch, n_in, _ = u.shape
    _, n_out, _, d_out = weight.shape
    return (
        u.new_empty(batch, n_out, d_out),
        u.new_empty(batch, n_in, n_out),
        u.new_empty(iterations - 1, batch, n_in, n_out),
        u.new_empty(batch, iterations, n_out, d_out),
        torch.empty_like(u, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op("capsnet::routing_cpu_backward", mutates_args=(), device_types="cpu")
def _routing_cpu_backward_op(
    grad_v: torch.Tensor | None,
    grad_c: torch.Tensor | None,
    u: torch.Tensor,
    weight: torch.Tensor,
    c_all: torch.Tensor,
    s_all: torch.Tensor,
    iterations: int,
    detach_votes: bool,
    need_u: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/du [B, in, in_d], dL/dW [in, out, in_d, out_d]), both contiguous; an empty tensor stands for a gradient
    that is not needed."""
    grad_u, grad_w = _kernel().backward(
        grad_v, grad_c, u, weight, c_all, s_all, iterations, detach_votes, need_u, need_w
    )
    return (grad_u if need_u else u.new_empty(0)), (grad_w if need_w else weight.new_empty(0))


@_routing_cpu_backward_op.register_fake
def _(grad_v, grad_c, u, weight, c_all, s_all, iterations, detach_votes, need_u, need_w):
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(u, memory_format=contiguous) if need_u else u.new_empty(0),
        torch.empty_like(weight, memory_format=contiguous) if need_w else weight.new_empty(0),
    )


def _setup_context(ctx, inputs, output) -> None:
    _, _, iterations, detach_votes = inputs
    _, _, c_all, s_all, u_c, w_c = output
    ctx.mark_non_differentiable(c_all, s_all, u_c, w_c)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(u_c, w_c, c_all, s_all)
    ctx.iterations, ctx.detach_votes = iterations, detach_votes


def _backward(ctx, grad_v, grad_c, *_):
    u, weight, c_all, s_all = ctx.saved_tensors
    need_u, need_w = ctx.needs_input_grad[:2]
    if (grad_v is None and grad_c is None) or not (need_u or need_w):
        return None, None, None, None
    grad_u, grad_w = _routing_cpu_backward_op(
        grad_v, grad_c, u, weight, c_all, s_all, ctx.iterations, ctx.detach_votes, need_u, need_w
    )
    return (grad_u if need_u else None), (grad_w if need_w else None), None, None


_routing_cpu_op.register_autograd(_backward, setup_context=_setup_context)


class CpuRouting:
    """Procedure 1 by the fused kernel: the `capsnet::routing_cpu` operator.

    `CpuRouting.apply(u [B, in, in_d], W [in, out, in_d, out_d], iterations, detach_votes)` (same dtype,
    float32/64) returns v [B, out, out_d] and the final coupling coefficients c [B, in, out]. Once differentiable.
    """

    @staticmethod
    def apply(u, weight, iterations, detach_votes):
        v, c, *_ = _routing_cpu_op(u, weight, iterations, detach_votes)
        return v, c


def cpu_dynamic_routing(
    u: torch.Tensor, weight: torch.Tensor, iterations: int, *, detach_votes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Votes û_j|i = W_ij u_i and Procedure 1 by the fused CPU kernel. u [B, in, in_d], W [in, out, in_d, out_d].

    Returns v [B, out, out_d] and the final c [B, in, out], as :func:`capsnet.routing.fast_dynamic_routing`.
    float64 inputs are routed in float64, anything else (e.g. bf16 under autocast) in float32.
    """
    dtype = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    with torch.autocast(device_type="cpu", enabled=False):
        return CpuRouting.apply(u.to(dtype), weight.to(dtype), iterations, detach_votes)
