"""In-memory data: a split of uint8 images and int64 labels, and a data set of a train and a test split."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_float(images: torch.Tensor) -> torch.Tensor:
    """Images as float32 in [0, 1]: uint8 pixels are divided by 255 (on their device); float images pass through
    as float32."""
    return images.float().div_(255.0) if images.dtype == torch.uint8 else images.float()


@dataclass(frozen=True)
class Split:
    """One split in memory: uint8 images [N, C, H, W] and int64 labels [N]; `channel_stats`, per-channel pixel mean
    and std, when the reader measured them on the originals before resizing (capsnet.data.scaling)."""

    images: torch.Tensor
    labels: torch.Tensor
    channel_stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Dataset:
    name: str
    source: str  # the folder the files came from, or "bundled"
    train: Split | None  # None for a test-only folder
    test: Split
    n_classes: int = 10
    class_names: tuple[str, ...] = ()  # one per class when the source names them (folders, CIFAR meta files)
    digits: bool = False  # MNIST-style ink images: `predict` inverts light backgrounds and fits a 20/28 box
    kind: str = ""  # the reader's format (capsnet.data.sources.FORMATS), which picks the default augmentation

    @property
    def names(self) -> tuple[str, ...]:
        """The class names, or "0", "1", ... when the source gives none."""
        return self.class_names or tuple(str(k) for k in range(self.n_classes))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images."""
        return tuple(self.test.images.shape[1:])  # type: ignore[return-value]
