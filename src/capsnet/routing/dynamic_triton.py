"""Dynamic routing on CUDA GPUs by Triton kernels: the CUDA implementation of the fused routing operator.

The fused operator `capsnet::routing_cpu` and its backward (`capsnet.routing.dynamic_cpu`; named after their
first kernel, the C++ one for CPUs) get CUDA kernels here, written in Triton (`.dynamic_triton_kernels`), with
the same inputs, outputs and saved tensors: torch.compile and DistributedDataParallel see one node on either device,
and the autograd registration is shared. As on the CPU, the votes are formed on chip and never stored, and the
backward pass is derived by hand.

Opt-in until a GPU measurement shows it faster than the PyTorch-op path: with the routing backend "triton"
(`capsnet.routing.set_backend`), or "auto" and ``CAPSNET_TRITON=1`` (Triton importable: CUDA builds of
PyTorch ship it; ``pip install 'capsnet[triton]'`` elsewhere), `capsnet.Router` routes plain Procedure 1 (not
leaky, no bias) on CUDA tensors here. Tests run the kernels on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import math
import os
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from ..errors import ConfigError
from . import dynamic_cpu
from .backend import resolve
from .base import autocast_off
from .extension import assume_constant_result

TILE = 4096  # elements of a program's largest tile (about 32 fp32 registers per thread at 4 warps)
_kernels: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """Whether CAPSNET_TRITON asks for the Triton kernels (CAPSNET_TRITON=1)."""
    return os.environ.get("CAPSNET_TRITON", "") not in ("", "0")


def kernels() -> ModuleType | None:
    """The kernels module, imported at the first call (None, after one warning, when Triton is missing). With
    TRITON_INTERPRET=1 set before Triton is first imported, its interpreter runs them (NumPy, on CPU tensors)."""
    if "module" not in _kernels:
        try:
            module: ModuleType | None = importlib.import_module(f"{__package__}.dynamic_triton_kernels")
        except ImportError as e:
            warnings.warn(
                f"capsnet: CAPSNET_TRITON is set but Triton cannot be imported ({e}); routing uses the PyTorch-op path",
                RuntimeWarning,
                stacklevel=2,
            )
            module = None
        _kernels["module"] = module
    return _kernels["module"]


@assume_constant_result
def available() -> bool:
    """CAPSNET_TRITON=1 and Triton importable (torch.compile takes the answer as a constant)."""
    return enabled() and kernels() is not None


MAX_ELEMENTS = 2**31 // 8  # the kernels index in int32: c_all [r-1, B, I, J] for r ≤ 9, and the rest, fit


def applicable(u: torch.Tensor, weight: torch.Tensor, backend: str | None = None) -> bool:
    """Whether `triton_dynamic_routing` takes (u, weight): CUDA tensors of a size the kernels index in int32,
    and the routing backend (`backend`, else the global one) "triton", or "auto" with CAPSNET_TRITON=1 set. The
    "triton" backend without an importable Triton is a ConfigError, as "cpp" without a kernel is."""
    sizes = u.shape[0] * weight.shape[0] * weight.shape[1] * weight.shape[3] <= MAX_ELEMENTS
    return u.device.type == "cuda" and weight.device.type == "cuda" and sizes and chosen(backend)


def chosen(backend: str | None = None) -> bool:
    """Whether the routing backend (`backend`, else the global one) asks for the Triton kernels on CUDA tensors:
    "triton" (a ConfigError when Triton cannot be imported), or "auto" with CAPSNET_TRITON=1 and Triton importable."""
    name = resolve(backend)
    if name == "triton":
        if kernels() is None:
            raise ConfigError("routing backend 'triton' needs Triton: pip install 'capsnet[triton]'")
        return True
    return name == "auto" and available()


# ------------------------------------------------------------------------------------------------ launches
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _floor_pow2(n: int) -> int:
    return 1 << max(0, int(math.log2(max(n, 1))))


@dataclass(frozen=True)
class Launch:
    """Tile sizes and work split: bb samples × bi input capsules per pass tile, the input capsules in n_split
    slices of slice_len; bi2 capsules × the batch in chunks of `chunk` samples per input-gradient program."""

    bb: int
    bi: int
    n_split: int
    slice_len: int
    bi2: int
    chunk: int
    num_warps: int = 4

    @classmethod
    def plan(cls, batch: int, n_in: int, n_out: int, d_in: int, d_out: int, programs: int) -> Launch:
        """About `programs` programs per launch (4 per multiprocessor on a GPU), tiles of at most TILE elements."""
        per_pair = _pow2(n_out) * _pow2(d_out)  # one (sample, input capsule) of a tile
        bb = min(4, _pow2(batch), max(1, _floor_pow2(TILE // per_pair)))
        bi = min(_pow2(n_in), max(1, _floor_pow2(TILE // (bb * per_pair))))
        n_split = max(1, min(_cdiv(programs, _cdiv(batch, bb)), _cdiv(n_in, bi)))  # slices per sample block
        slice_len = _cdiv(_cdiv(n_in, n_split), bi) * bi
        bi2 = min(_pow2(n_in), max(1, _floor_pow2(TILE // (per_pair * _pow2(d_in)))))
        n_chunks = max(1, min(_cdiv(programs, _cdiv(n_in, bi2)), batch))
        return cls(bb, bi, _cdiv(n_in, slice_len), slice_len, bi2, _cdiv(batch, n_chunks))


def _launch(u: torch.Tensor, weight: torch.Tensor, launch: Launch | None) -> Launch:
    if launch is not None:
        return launch
    programs = 4 * torch.cuda.get_device_properties(u.device).multi_processor_count if u.is_cuda else 4
    batch, n_in, d_in = u.shape
    return Launch.plan(batch, n_in, weight.shape[1], d_in, weight.shape[3], programs)


def _sizes(u: torch.Tensor, weight: torch.Tensor, k: ModuleType) -> dict:
    """The kernels' compile-time sizes (N; J, M and N rounded up to powers of two) and dtype."""
    _, n_out, d_in, d_out = weight.shape
    dtype = k.tl.float64 if u.dtype == torch.float64 else k.tl.float32
    return {"N": d_in, "BJ": _pow2(n_out), "BM": _pow2(d_out), "DTYPE": dtype}


def forward(u: torch.Tensor, weight: torch.Tensor, iterations: int, launch: Launch | None = None):
    """Procedure 1 by the kernels: (v [B, J, M], c_all [r-1, B, I, J], s_all [B, r, J, M]) for contiguous u
    [B, I, N] and W [I, J, N, M] of one dtype (float32/64), the layouts of csrc/routing_cpu.cpp."""
    k, plan = kernels(), _launch(u, weight, launch)
    assert k is not None
    batch, n_in, _ = u.shape
    _, n_out, _, d_out = weight.shape
    sizes = _sizes(u, weight, k)
    part = u.new_empty(iterations, plan.n_split, batch, n_out, d_out)  # each slice's part of s_t
    c_all = u.new_empty(max(iterations - 1, 1), batch, n_in, n_out)
    s_all, v = u.new_empty(batch, iterations, n_out, d_out), u.new_empty(batch, n_out, d_out)
    blocks = _cdiv(batch, plan.bb)
    for t in range(iterations + 1):  # t = r: no capsules, only s_{r-1} and v
        grid = (blocks, plan.n_split if t < iterations else 1)
        k.forward_pass[grid](
            u,
            weight,
            part,
            c_all,
            s_all,
            v,
            t,
            batch,
            n_in,
            n_out,
            d_out,
            plan.n_split,
            plan.slice_len if t < iterations else 0,
            R=iterations,
            BB=plan.bb,
            BI=plan.bi,
            EPS=k.EPS,
            num_warps=plan.num_warps,
            **sizes,
        )
    return v, c_all[: iterations - 1], s_all


def backward(
    grad_v,
    grad_c,
    u,
    weight,
    c_all,
    s_all,
    iterations: int,
    detach_votes: bool,
    need_u: bool,
    need_w: bool,
    launch: Launch | None = None,
):
    """(dL/du [B, I, N] or None, dL/dW [I, J, N, M] or None) from the saved tensors of `forward`;
    grad_v [B, J, M] and grad_c [B, I, J] may be None (zero)."""
    k, plan = kernels(), _launch(u, weight, launch)
    assert k is not None
    batch, n_in, d_in = u.shape
    _, n_out, _, d_out = weight.shape
    sizes = _sizes(u, weight, k)
    through = not detach_votes and iterations > 1  # the gradient flows through the routing passes
    gv = grad_v.to(u.dtype).contiguous() if grad_v is not None else u
    gc = grad_c.to(u.dtype).contiguous() if grad_c is not None else u
    ds_all = torch.zeros_like(s_all)
    dv_part = u.new_empty(iterations, plan.n_split, batch, n_out, d_out)  # each slice's part of dV_t
    g_all = u.new_empty(iterations - 1, batch, n_in, n_out) if through else u  # db_t, t ≥ 1
    blocks = _cdiv(batch, plan.bb)
    flags = {"HAS_GV": grad_v is not None, "R": iterations, "BB": plan.bb, "EPS": k.EPS}
    for t in range(iterations - 1, 0, -1) if through else ():
        k.backward_pass[(blocks, plan.n_split)](
            u,
            weight,
            s_all,
            c_all,
            gv,
            gc,
            dv_part,
            g_all,
            ds_all,
            t,
            batch,
            n_in,
            n_out,
            d_out,
            plan.n_split,
            plan.slice_len,
            BI=plan.bi,
            HAS_GC=grad_c is not None,
            num_warps=plan.num_warps,
            **flags,
            **sizes,
        )
    v_sums = torch.empty_like(s_all)  # V_t = Σ_{t' < t} v_t'
    k.backward_finish[(blocks,)](
        s_all,
        gv,
        dv_part,
        ds_all,
        v_sums,
        batch,
        n_out,
        d_out,
        plan.n_split,
        THROUGH=through,
        num_warps=plan.num_warps,
        **flags,
        **{n: sizes[n] for n in ("BJ", "BM", "DTYPE")},
    )
    du = u.new_empty(batch, n_in, d_in) if need_u else u
    n_chunks = _cdiv(batch, plan.chunk)
    dw_part = weight.new_empty(n_chunks, *weight.shape) if need_w else weight
    grid = (_cdiv(n_in, plan.bi2), n_chunks)
    k.grad_inputs[grid](
        u,
        weight,
        c_all,
        g_all,
        ds_all,
        v_sums,
        du,
        dw_part,
        batch,
        n_in,
        n_out,
        d_out,
        plan.chunk,
        R=iterations,
        BI=plan.bi2,
        BN=_pow2(d_in),
        THROUGH=through,
        NEED_U=need_u,
        NEED_W=need_w,
        num_warps=2 * plan.num_warps,
        **sizes,
    )
    grad_w = (dw_part[0] if n_chunks == 1 else dw_part.sum(dim=0)) if need_w else None
    return (du if need_u else None), grad_w


# ------------------------------------------------------------------------------------------------ the operator
@dynamic_cpu._routing_cpu_op.register_kernel("cuda")
def _cuda_routing(u, weight, iterations, detach_votes):
    """The CUDA kernel of `capsnet::routing_cpu`: the CPU kernel's outputs, by the Triton kernels."""
    u_c = torch.empty_like(u, memory_format=torch.contiguous_format).copy_(u)
    w_c = torch.empty_like(weight, memory_format=torch.contiguous_format).copy_(weight)
    v, c_all, s_all = forward(u_c, w_c, iterations)
    if iterations > 1:
        c = c_all[-1].clone()
    else:  # the single pass couples uniformly
        c = u.new_full((u.shape[0], weight.shape[0], weight.shape[1]), 1.0 / weight.shape[1])
    return v, c, c_all, s_all, u_c, w_c


@dynamic_cpu._routing_cpu_backward_op.register_kernel("cuda")
def _cuda_routing_backward(grad_v, grad_c, u, weight, c_all, s_all, iterations, detach_votes, need_u, need_w):
    grad_u, grad_w = backward(grad_v, grad_c, u, weight, c_all, s_all, iterations, detach_votes, need_u, need_w)
    return (grad_u if need_u else u.new_empty(0)), (grad_w if need_w else weight.new_empty(0))


def triton_dynamic_routing(
    u: torch.Tensor, weight: torch.Tensor, iterations: int, *, detach_votes: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Votes û_j|i = W_ij u_i and Procedure 1 by the Triton kernels (CUDA tensors; `applicable`).
    u [B, in, in_d], W [in, out, in_d, out_d] -> v [B, out, out_d], the final c [B, in, out]. float64 inputs are
    routed in float64, anything else (e.g. bf16 under autocast) in float32."""
    dtype = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    with autocast_off("cuda"):
        return dynamic_cpu.CpuRouting.apply(u.to(dtype), weight.to(dtype), iterations, detach_votes)
