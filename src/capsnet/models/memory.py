"""A training step's memory, estimated from the model's config before anything is allocated.

Users of other capsule implementations report running out of memory at 224 px: the number of primary capsules
grows with the image area, and routing's memory with it. `capsnet train` calls `check_memory` before
building the model; above the budget (the device's free memory) it stops with one line naming the fixes.

The estimate counts fp32 numbers: parameters with their gradients and Adam's two moments, and per example the
activations kept for the backward pass (convolutions, primary capsules, routing's s_t and c_t) plus routing's
temporaries: for the fast paths (`capsnet.routing.dynamic_fast`) about LIVE_TEMPORARIES tensors of
[out, chunk, in_d, in], the chunk bounded by the path's chunk size; for the reference path (taken only by a
capsule bias with detach_votes) about 2r+1 tensors of the votes [B, in, out, out_d]. It is meant to catch a
configuration that cannot fit, not to predict the peak exactly (docs/benchmarks.md compares it with measured
peaks). Only CapsNet with dynamic routing is modelled (COVERS, named in the check's line); the other models and
routings are not checked before training (running out of GPU memory still ends in one line, from the CLI).

On CPUs the budget is Linux's MemAvailable, which counts the page cache the kernel can hand back.
"""

from __future__ import annotations

import itertools
import os

import torch

from ..configs.base import image_hw
from ..configs.capsnet import CapsNetConfig
from ..errors import ConfigError
from ..routing.dynamic_fast import GPU_TEMPORARY_BYTES

FLOAT = 4
LIVE_TEMPORARIES = 7  # [out, chunk, in_d, in] tensors alive at once in the fast path's backward (x_buf holds 4)
MEMINFO = "/proc/meminfo"
# What the estimate models; the other models and routings train unchecked (check_memory returns None).
COVERS = "CapsNet with dynamic routing"


def _conv(side: int, kernel: int, stride: int, pad: int) -> int:
    return (side + 2 * pad - kernel) // stride + 1


def capsnet_bytes(cfg, batch: int, device_type: str = "cuda") -> int | None:
    """Estimated peak bytes of one CapsNet training step at `batch` on a `device_type` device (None for configs it
    does not model)."""
    if not isinstance(cfg, CapsNetConfig) or cfg.routing != "dynamic":
        return None
    h, w = image_hw(cfg.image_size)
    k = cfg.kernel_size
    pad = k // 2 if cfg.padding == "same" else 0
    stride = cfg.conv1_stride
    h1, w1 = _conv(h, k, stride, pad), _conv(w, k, stride, pad)
    h2, w2 = _conv(h1, k, 2, pad), _conv(w1, k, 2, pad)
    n_in, n_out, r = cfg.primary_types * h2 * w2, cfg.n_classes, cfg.routing_iterations
    assert r is not None  # (CapsNetConfig resolves it to the routing's own)
    d_in, d_out = cfg.primary_dim, cfg.class_dim
    conv_params = (cfg.in_channels + cfg.primary_types * d_in) * cfg.conv_channels * k * k
    route_params = n_in * n_out * d_in * d_out
    decoder = 0
    if cfg.decoder:
        sizes = [n_out * d_out, *cfg.decoder_hidden, cfg.in_channels * h * w]
        decoder = sum(a * b for a, b in itertools.pairwise(sizes))
    params = 4 * (conv_params + route_params + decoder)  # weights, gradients, Adam's m and v
    per_example = cfg.in_channels * h * w
    per_example += 3 * cfg.conv_channels * h1 * w1  # conv1 output, ReLU, their gradient
    per_example += 4 * n_in * d_in  # primary conv output, squash, gradients
    temporaries = 0
    reference = (cfg.capsule_bias and cfg.detach_votes) or getattr(cfg, "coupling", "outputs") != "outputs"
    if reference:  # the reference path keeps the votes and per-pass products
        per_example += (2 * r + 1) * n_in * n_out * d_out
    else:  # the fast paths keep s_t, c_t, u and du; their [out, chunk, in_d, in] temporaries are bounded per chunk
        per_example += r * n_out * (n_in + d_out) + 2 * n_in * d_in
        one = FLOAT * n_out * n_in * d_in  # one temporary, per example
        cap = (12 << 20) if device_type == "cpu" else GPU_TEMPORARY_BYTES
        temporaries = LIVE_TEMPORARIES * min(batch * one, max(cap, one))
    if decoder:
        per_example += 2 * (sum(cfg.decoder_hidden) + cfg.in_channels * h * w)
    return FLOAT * (params + batch * per_example) + temporaries


def budget_bytes(device: torch.device) -> int | None:
    """The memory a step may use: free memory on CUDA; on CPUs the memory available to a new process
    (`available_host_bytes`), None where that cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_host_bytes()


def available_host_bytes(meminfo: str | None = None) -> int | None:
    """Linux's MemAvailable (free memory plus the page cache and other memory the kernel can reclaim), from
    /proc/meminfo; where that has none (other systems, kernels before 3.14), the free pages (SC_AVPHYS_PAGES), which
    leave out the page cache and so under-count; None where neither can be read."""
    try:
        with open(meminfo or MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, *unit = line.split(":", 1)[1].split()
                    return int(value) * (1024 if unit == ["kB"] else 1)
    except (OSError, ValueError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg, batch: int, device: torch.device, *, budget: int | None = None) -> int | None:
    """ConfigError (one line, with the fixes) if a CapsNet training step would need more than `budget` bytes
    (default: `budget_bytes`). Returns the estimate; None when the model is not estimated (only COVERS is)."""
    need = capsnet_bytes(cfg, batch, device.type)
    budget = budget if budget is not None else budget_bytes(device)
    if need is None or budget is None or need <= budget:
        return need
    h, w = image_hw(cfg.image_size)
    gib = 1 << 30
    raise ConfigError(
        f"a training step of {COVERS} would need about {need / gib:.1f} GiB at batch {batch} ({h}x{w} images, "
        f"{cfg.primary_types} primary types), more than the {budget / gib:.1f} GiB free on {device.type}; use "
        f"--conv1-stride 2, a smaller --image-size (e.g. {max(h // 2, 8)}x{max(w // 2, 8)}), fewer --primary-types, "
        "or a smaller --batch-size"
    )
