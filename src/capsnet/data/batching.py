"""Batching by tensor indexing: seeded per-epoch shuffles, rank shards for torchrun, uint8 -> float on the device."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..pixels import to_float
from .split import Split


def num_batches(n: int, *, batch_size: int, world_size: int = 1, drop_last: bool = False) -> int:
    """How many batches `iterate_batches` yields on every rank for a split of `n` examples."""
    per_rank = n // world_size if drop_last else -(-n // world_size)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def _epoch_seed(seed: int, epoch: int) -> int:
    # SeedSequence mixes (seed, epoch) well, so neighbouring epochs get unrelated permutations.
    return int(np.random.SeedSequence([seed & (2**63 - 1), epoch & (2**63 - 1)]).generate_state(1, np.uint64)[0])


def shard_indices(order: torch.Tensor, *, rank: int, world_size: int, drop_last: bool = False) -> torch.Tensor:
    """Rank `rank`'s share of the indices `order` [n]: every world_size-th one, starting at `rank`.

    So that every rank gets the same number, the end wraps around to the start (or, with drop_last, the
    remainder is dropped): n = 5, world_size = 2 gives ranks [o0, o2, o4] and [o1, o3, o0].
    """
    n = len(order)
    if drop_last:
        order = order[: (n // world_size) * world_size]
    else:
        total = -(-n // world_size) * world_size
        if total > n:  # wrap around so every rank has the same number of examples
            order = torch.cat([order] * (-(-total // n)))[:total]
    return order[rank::world_size]


def _shard(
    n: int, *, shuffle: bool, seed: int, epoch: int, rank: int, world_size: int, drop_last: bool, repeats: int = 1
):
    # `repeats` passes in one epoch: every example `repeats` times, in one permutation of n × repeats slots (the
    # same order as before for 1: randperm(n) % n is randperm(n)).
    if shuffle:
        g = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
        order = torch.randperm(n * repeats, generator=g) % n
    else:
        order = torch.arange(n).repeat(repeats)
    return shard_indices(order, rank=rank, world_size=world_size, drop_last=drop_last)


def epoch_indices(
    n: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    repeats: int = 1,
) -> torch.Tensor:
    """This rank's example indices for `epoch`, in the order `iterate_batches` visits them (on the CPU); with
    `repeats`, an epoch of that many passes over the n examples (each example `repeats` times)."""
    shard = {"rank": rank, "world_size": world_size, "repeats": repeats}
    return _shard(n, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, **shard)


def iterate_batches(
    split: Split,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    repeats: int = 1,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (images float32 [B, C, H, W] in [0, 1], labels int64 [B]) on `device`.

    The order is a permutation seeded by (seed, epoch): the same on every rank and every run, new
    each epoch. Rank r takes every world_size-th example; the end wraps so all ranks yield
    `num_batches(...)` batches (with drop_last, the remainder is dropped instead). `repeats`: passes over the
    split in one epoch (`num_batches` of len(split) × repeats examples).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    shard = {"rank": rank, "world_size": world_size, "repeats": repeats}
    idx = _shard(len(split), shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last, **shard)
    return _batches(split, idx, batch_size=batch_size, drop_last=drop_last, device=torch.device(device))


def _batches(split: Split, idx: torch.Tensor, *, batch_size: int, drop_last: bool, device: torch.device):
    stop = (len(idx) // batch_size) * batch_size if drop_last else len(idx)
    idx = idx.to(split.images.device)  # a split already on the device is indexed there (one copy per epoch)
    for start in range(0, stop, batch_size):
        take = idx[start : start + batch_size]
        # Move uint8 (4× smaller than float) and convert on the device.
        images = to_float(split.images[take].to(device, non_blocking=True))
        yield images, split.labels[take].to(device, non_blocking=True)
