"""In-memory data: a split of uint8 images and int64 labels, and a data set of a train and a test split."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """One split in memory: uint8 images [N, C, H, W] and int64 labels [N]."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Dataset:
    name: str
    source: str  # the folder the files came from, or "bundled"
    train: Split | None  # None for a test-only folder
    test: Split
    n_classes: int = 10
