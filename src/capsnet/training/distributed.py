"""torchrun support: process-group set-up from the environment, and metric reduction over ranks.

`torchrun --nproc_per_node=N -m capsnet train ...` sets RANK, WORLD_SIZE and LOCAL_RANK; multi-node runs use
torchrun's usual --nnodes/--node_rank/--rdzv flags. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: torch.device) -> DistInfo:
    """Join the process group if launched by torchrun (WORLD_SIZE > 1); otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return info


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Sum a list of numbers over all ranks (identity for a single process)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (used to stop all ranks together)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
