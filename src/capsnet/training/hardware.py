"""What the training device can do and decides: which device, its default batch, whether bf16 runs natively.

Default batch per process (`TrainConfig.batch_size` unset), with the model's own learning rate (CapsNet: Adam 1e-3,
the paper's TensorFlow recipe at batch 128):

    cpu    16   tuned on a 2-core CPU (docs/benchmarks.md): small batches keep the routing temporaries in cache
    cuda  128   the paper's batch; not yet measured on a GPU (benchmarks/gpu_check.py measures 128 and 512)

bf16 autocast pays only where the hardware multiplies bf16 natively: CUDA GPUs that report bf16 support (Ampere
and newer), and CPUs with AVX512_BF16 or AMX. Elsewhere bf16 is emulated; on an AVX2-only EPYC a CapsNet step ran
12x slower in bf16 than in fp32, so `capsnet train --precision bf16` says so in one line before training.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..errors import ConfigError
from ..logs import LOGGER
from ..models.registry import MODELS
from .distributed import DistInfo

DEFAULT_BATCH = {"cpu": 16, "cuda": 128}


def default_batch_size(device: torch.device) -> int:
    """The documented default batch per process on this kind of device (see the table above)."""
    return DEFAULT_BATCH.get(device.type, DEFAULT_BATCH["cpu"])


def batch_size_for(model: object, device: torch.device) -> tuple[int, bool]:
    """The batch a run of registry `model` takes on `device` when none is set: the model's recipe where it has one,
    else the device's default; and whether it is the recipe's."""
    recipe = getattr(MODELS[model], "default_batch_size", None) if isinstance(model, str) and model in MODELS else None
    return recipe or default_batch_size(device), bool(recipe)


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when available, else the CPU), `cpu`, `cuda` or `cuda:K`; a ConfigError for anything else."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:K") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available")
    return device


def rank_device(device: torch.device, dist: DistInfo) -> torch.device:
    """Under torchrun each process trains on the GPU cuda:LOCAL_RANK. A `--device cuda:K` that names another GPU
    cannot hold: all ranks on one GPU would deadlock NCCL. Rank 0 says so in one line instead of silently replacing
    it."""
    if device.type != "cuda" or not dist.enabled:
        return device
    local = torch.device("cuda", dist.local_rank)
    if device.index is not None and device.index != dist.local_rank and dist.is_main:
        LOGGER.warning(
            f"capsnet: --device {device} ignored under torchrun: rank r trains on cuda:LOCAL_RANK (rank 0 on "
            f"{local}); choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    return local


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512_BF16 or AMX (torch's own probe, else /proc/cpuinfo)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(callable(p) for p in probes):
        return any(callable(p) and p() for p in probes)
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def bf16_native(device: torch.device) -> bool:
    """Whether `device` runs bf16 matrix work natively (CUDA: torch.cuda.is_bf16_supported; CPU: AVX512_BF16/AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_bf16_native()
    return False


def precision_note(device: torch.device, precision: str) -> str | None:
    """One line for the user when `precision` does not fit the hardware (bf16 without native support), else None."""
    if precision != "bf16" or bf16_native(device):
        return None
    what = {"cuda": "this GPU", "cpu": "this CPU (no AVX512_BF16 or AMX)"}.get(device.type, str(device))
    return (
        f"capsnet: --precision bf16 is emulated on {what} and may run many times slower than fp32; "
        "--precision fp32 is the faster choice here"
    )


def device_settings(
    config: Any, device: torch.device, *, flag: str, batches: bool, notes: list[tuple[str, int]]
) -> Any:
    """`config` with its batch size resolved (the model's recipe, else the device's default) and what was chosen
    for the user appended to `notes` as (line, logging level): the batch size when the run `batches` at it, and a
    precision the device emulates."""
    if config.batch_size is None:
        name = getattr(config, "model", None)  # (a FitConfig names no registry model)
        batch, recipe = batch_size_for(name, device)
        config = dataclasses.replace(config, batch_size=batch)
        if batches:
            option = "--batch-size" if flag.startswith("--") else "batch_size="
            whose = f"{name}'s recipe" if recipe else f"the {device.type} default"
            notes.append(
                (f"batch size {config.batch_size} per process ({whose}; set {option} to change)", logging.INFO)
            )
    note = precision_note(device, config.precision)
    if note:
        notes.append((note, logging.WARNING))
    return config
