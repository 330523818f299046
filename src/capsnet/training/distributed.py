"""torchrun support: process-group set-up from the environment, and metric reduction over ranks.

`torchrun --nproc_per_node=N -m capsnet train ...` sets RANK, WORLD_SIZE and LOCAL_RANK; multi-node runs use
torchrun's usual --nnodes/--node_rank/--rdzv flags. gloo on CPU, NCCL on GPU: each process first binds to its
GPU cuda:LOCAL_RANK (torch.cuda.set_device, and `device_id` for init_process_group), so that NCCL's communicator
is created on the right device.
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


def from_env() -> DistInfo:
    """This process's place under torchrun (RANK, WORLD_SIZE, LOCAL_RANK); a single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    return DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))


def setup(device: torch.device, info: DistInfo | None = None) -> DistInfo:
    """Join the process group if launched by torchrun (WORLD_SIZE > 1); otherwise a single process.

    On CUDA, `device` is this rank's GPU: it becomes the current device before NCCL is initialised."""
    info = info if info is not None else from_env()
    if not info.enabled or dist.is_initialized():
        return info
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device)
    else:
        dist.init_process_group(backend="gloo")
    return info


def teardown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def all_sum_tensor(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """`t` summed over all ranks, in place (no host sync: the result stays on the device)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Sum a list of numbers over all ranks (identity for a single process)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    return all_sum_tensor(t, info).tolist()


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (used to stop all ranks together). One collective and one
    host sync: the training loop calls it every STOP_CHECK_EVERY steps, not every step."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
