"""capsnet.fit's task: batches from a torch Dataset or an iterable of batches, such as a DataLoader.

- A **Dataset** (map-style: `__getitem__` and `__len__`, e.g. a torch.utils.data.Dataset subclass of one's own)
  yields `(image, label)`: the image a tensor [C, H, W] (uint8 pixels, or floats in [0, 1]: the model's input
  recipe, capsnet.models.recipe, turns them into its input), the label a class index. capsnet batches it with
  `SeededSampler`: a fresh permutation each epoch, seeded by (seed, epoch) as `capsnet train` shuffles,
  sharded over torchrun ranks as DistributedSampler shards.
  A run stopped mid-epoch resumes at the batch where it stopped: the done batches are skipped without being read.
- An **iterable of batches** (a DataLoader, a list of batches, a streaming source without `__len__`) yields
  `(images [B, C, H, W], labels [B])`; it is read as it is, a new pass each epoch (so it must be re-iterable, not a
  one-shot iterator); a sampler with `set_epoch` (DistributedSampler) is told the epoch. Its order cannot be
  replayed, so a run stopped mid-epoch keeps the checkpoint of its last finished epoch and redoes the epoch.
  Under torchrun each rank reads its own iterable (shard it, e.g. with a DistributedSampler), and the training
  iterables must have a length, the same on every rank (every rank takes as many steps).

Validation: `val_data` if given; else, for a Dataset, a seeded, stratified `val_fraction` of it held out
(`capsnet.data.split.holdout_indices`, as `capsnet train --val-fraction`); else none, and best/ is chosen on
the test data (its test figure is then a maximum over epochs, as with `--val-fraction 0`), or without test data
on the training loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler, Subset

from ..data.batching import epoch_indices, num_batches
from ..data.split import holdout_indices
from ..errors import ConfigError, DatasetError
from ..models.recipe import InputRecipe
from . import distributed as dist_utils
from .evaluator import evaluate_batches
from .record import FIT_TASK
from .tasks import Batch, Task, mix_seed


def is_dataset(data: Any) -> bool:
    """Whether `data` is read as a map-style Dataset of examples (else: as an iterable of batches). A list or a
    tuple is a sequence of batches; a DataLoader and an IterableDataset are iterables."""
    if isinstance(data, (DataLoader, IterableDataset, list, tuple)):
        return False
    return isinstance(data, torch.utils.data.Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__"))


class SeededSampler(DistributedSampler):
    """A Dataset's indices for one epoch on one rank: capsnet's seeded permutation (capsnet.data.batching), sharded
    as DistributedSampler shards (every world_size-th index; the end wraps so that every rank has as many), from
    example `start` (a resumed epoch's first batch not yet done times the batch size)."""

    def __init__(self, n: int, *, seed: int, rank: int = 0, world_size: int = 1, start: int = 0, repeats: int = 1):
        slots = cast(Any, range(n * repeats))  # an epoch of `repeats` passes (capsnet.data.batching.epoch_indices)
        super().__init__(slots, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.n, self.start, self.repeats = n, start, repeats

    def __iter__(self) -> Iterator[int]:
        idx = epoch_indices(
            self.n,
            shuffle=True,
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.num_replicas,
            repeats=self.repeats,
        )
        return iter(idx[self.start :].tolist())

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)


class _Shard(Sampler[int]):
    """Evaluation: rank r scores the examples r, r + world_size, ... (each example once over all ranks)."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.indices = range(rank, n, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def check_example(item: Any, where: str) -> None:
    """DatasetError unless `item` is (image [C, H, W] tensor, float or uint8; an integer class index)."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise DatasetError(f"{where}: expected an (image, label) pair, got {type(item).__name__}")
    image, label = item
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        got = f"shape {list(image.shape)}" if isinstance(image, torch.Tensor) else type(image).__name__
        raise DatasetError(f"{where}: the image is {got}; expected a tensor [C, H, W] (float, or uint8 for /255)")
    _check_dtype(image, where)
    check_range(image, where)
    if not _is_index(label):
        raise DatasetError(f"{where}: the label is {label!r}; expected a class index (an int)")


def check_batch(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels int64) of a batch; DatasetError unless it is (images [B, C, H, W], labels [B])."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise DatasetError(f"{where}: expected an (images, labels) batch, got {type(batch).__name__}")
    images, labels = batch
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        got = f"shape {list(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        hint = " (a Dataset of single examples goes in as it is, or in a DataLoader)" if got.count(",") == 2 else ""
        raise DatasetError(f"{where}: the images are {got}; expected a batch [B, C, H, W]{hint}")
    _check_dtype(images, where)
    if not isinstance(labels, torch.Tensor) or labels.shape != images.shape[:1] or labels.is_floating_point():
        got = f"{list(labels.shape)} {labels.dtype}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise DatasetError(f"{where}: the labels are {got}; expected class indices [{images.shape[0]}] (integers)")
    return images, labels.long()


def _check_dtype(images: torch.Tensor, where: str) -> None:
    if not (images.is_floating_point() or images.dtype == torch.uint8):
        raise DatasetError(f"{where}: images of dtype {images.dtype}; expected float, or uint8 for /255")


# How far past [0, 1] float images may reach: added noise or rounding is data as it comes; pixels 0-255 and
# standardised images (MNIST's reach 2.8) are another contract.
RANGE_SLACK = 0.1


def check_range(images: torch.Tensor, where: str) -> None:
    """DatasetError unless float images are x01 = pixels / 255, in [0, 1] (the contract every model's recipe
    starts from). Called on a first example or batch only: it reads the values (a sync on a GPU tensor)."""
    if images.is_floating_point() and images.numel():
        low, high = float(images.min()), float(images.max())
        if low < -RANGE_SLACK or high > 1 + RANGE_SLACK:
            raise DatasetError(
                f"{where}: float pixels span [{low:g}, {high:g}]; float images must be in [0, 1] "
                "(pixels / 255): divide by 255, or give uint8 pixels"
            )


def _is_index(label: Any) -> bool:
    if isinstance(label, torch.Tensor):
        return label.dim() == 0 and not label.is_floating_point() and label.dtype != torch.bool
    return hasattr(label, "__index__") and not isinstance(label, bool)


def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples (image [C, H, W], label) -> (images [B, C, H, W], labels int64 [B])."""
    images = [image for image, _ in items]
    if any(x.shape != images[0].shape for x in images):
        shapes = sorted({"x".join(map(str, x.shape)) for x in images})
        raise DatasetError(f"the images of one batch differ in shape: {', '.join(shapes)}")
    return torch.stack(images), torch.tensor([int(label) for _, label in items], dtype=torch.int64)


def dataset_labels(data: Any) -> torch.Tensor:
    """The class index of every example: the Dataset's `targets` (or `labels`) when it has one of the right length,
    else read example by example (each image is loaded once)."""
    for name in ("targets", "labels"):
        values = getattr(data, name, None)
        if values is not None:
            try:
                labels = torch.as_tensor(values)
            except (TypeError, ValueError, RuntimeError):
                continue
            if labels.dim() == 1 and len(labels) == len(data) and not labels.is_floating_point():
                return labels.long()
    return torch.tensor([int(data[i][1]) for i in range(len(data))], dtype=torch.int64)


class Source:
    """One of train_data, val_data and test_data, checked when given."""

    def __init__(self, data: Any, part: str, *, workers: int = 0):
        self.data, self.part, self.workers = data, part, workers
        self.indexed = is_dataset(data)
        if self.indexed:
            if len(data) == 0:
                raise DatasetError(f"{part}_data is empty")
            check_example(data[0], f"{part}_data[0]")
        elif not hasattr(data, "__iter__"):
            raise DatasetError(
                f"{part}_data: a {type(data).__name__} is neither a Dataset of (image, label) "
                "examples nor an iterable of (images, labels) batches"
            )
        elif iter(data) is data:
            raise DatasetError(
                f"{part}_data is an iterator, which can be read only once; give something each epoch "
                "can read anew (a DataLoader, a list of batches, a Dataset)"
            )

    def length(self) -> int | None:
        """Examples of a Dataset; batches of an iterable (None when it has no length)."""
        try:
            return len(self.data)
        except TypeError:
            return None

    def describe(self) -> dict[str, Any]:
        data = self.data.dataset if isinstance(self.data, Subset) else self.data
        kind = "dataset" if self.indexed else "batches"
        return {"type": type(data).__qualname__, "kind": kind, ("n" if self.indexed else "batches"): self.length()}

    def loader(self, sampler: Sampler, *, batch_size: int, device: torch.device, seed: int) -> DataLoader:
        """A DataLoader over a Dataset: `workers` processes, seeded by `seed` (not by the global random state)."""
        return DataLoader(
            self.data,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=self.workers,
            collate_fn=collate,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(seed),
        )

    def passes(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over an iterable of batches, checked batch by batch (shapes only: no device sync)."""
        batch_sampler = getattr(self.data, "batch_sampler", None)
        for sampler in (getattr(self.data, "sampler", None), getattr(batch_sampler, "sampler", None)):
            if sampler is not None and hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        for k, batch in enumerate(self.data):
            images, labels = check_batch(batch, f"{self.part}_data batch {k}")
            if k == 0 and epoch == 0:
                check_range(images, f"{self.part}_data batch 0")
            yield images, labels


def _on_device(images: torch.Tensor, labels: torch.Tensor, device: torch.device, recipe: InputRecipe) -> Batch:
    """A batch of raw images on `device` (uint8 moves, 4x smaller, and converts there) as the model's input."""
    images = recipe.prepare(images.to(device, non_blocking=True))
    return Batch(images, labels.to(device, non_blocking=True))


class LoaderTask(Task):
    """Classification on a Dataset or an iterable of batches (see the module docstring): the model's own
    `loss(out, images, labels)`, accuracy from `out.predictions`. Every batch goes through `recipe`, the model's
    (capsnet.models.recipe.recipe_of): raw images become what the model was built to take."""

    name = FIT_TASK

    def __init__(
        self,
        train: Any,
        *,
        val: Any = None,
        test: Any = None,
        val_fraction: float = 0.1,
        val_seed: int = 0,
        workers: int = 0,
        recipe: InputRecipe | None = None,
    ):
        self.recipe = recipe if recipe is not None else InputRecipe()
        self.source = Source(train, "train", workers=workers)
        self.val = Source(val, "val", workers=workers) if val is not None else None
        self.test = Source(test, "test", workers=workers) if test is not None else None
        validation: dict[str, Any] = {"source": "given", "n": self.val.length()} if self.val else {"source": "none"}
        self.labels: torch.Tensor | None = None  # a Dataset's labels, when read for the hold-out
        if self.val is None and val_fraction > 0 and self.source.indexed:
            self.labels = dataset_labels(train)
            kept, held = holdout_indices(self.labels, val_fraction, seed=val_seed)
            self.source = Source(Subset(train, kept.tolist()), "train", workers=workers)
            self.val = Source(Subset(train, held.tolist()), "val", workers=workers)
            validation = {
                "source": "held out of the training split",
                "fraction": val_fraction,
                "seed": val_seed,
                "n": len(held),
            }
        # A Dataset's epoch can repeat it, and is the user's own data (capsnet.training.config.MIN_EPOCH_STEPS).
        self.repeatable = self.own_data = self.source.indexed
        parts = {"train": self.source, "val": self.val, "test": self.test}
        self.recorded: dict[str, Any] = {
            "validation": validation,
            "data": {k: s.describe() for k, s in parts.items() if s is not None},
        }

    @property
    def has_val(self) -> bool:
        return self.val is not None

    @property
    def has_test(self) -> bool:
        return self.test is not None

    @property
    def resumes_mid_epoch(self) -> bool:  # type: ignore[override]  # (a class attribute in Task)
        return self.source.indexed

    def selection_note(self) -> str | None:
        if self.has_val:
            return None
        why = "val_fraction=0" if self.source.indexed else "train_data is an iterable of batches, none held out"
        if self.has_test:
            return (
                f"capsnet.fit: no validation data (val_data=None, {why}): best/ is chosen on test_data, so its "
                "test accuracy is a maximum over epochs, not an estimate"
            )
        return f"capsnet.fit: no validation or test data (val_data=None, {why}): best/ is the lowest training loss's"

    def num_batches(self, *, batch_size: int, world_size: int) -> int | None:  # type: ignore[override]
        if self.source.indexed:
            return num_batches(len(self.source.data) * self.repeats, batch_size=batch_size, world_size=world_size)
        return self.source.length()  # (None for a streaming source)

    def check_ranks(self, dist: dist_utils.DistInfo) -> None:
        """Under torchrun, ConfigError unless every rank's training iterable has one and the same length."""
        if not dist.enabled or self.source.indexed:
            return
        lengths: list[Any] = [None] * dist.world_size
        torch.distributed.all_gather_object(lengths, self.source.length())
        if None in lengths or len(set(lengths)) > 1:
            raise ConfigError(
                f"under torchrun every rank's train_data must have a length, the same on every rank "
                f"(a step is taken together); the ranks' lengths: {lengths}"
            )

    def batches(self, *, epoch, batch_size, seed, rank, world_size, device, generator, start=0) -> Iterator[Batch]:
        if not self.source.indexed:  # (start is 0: such a run resumes at an epoch's start)
            for images, labels in self.source.passes(epoch):
                yield _on_device(images, labels, device, self.recipe)
            return
        n = len(self.source.data)
        sampler = SeededSampler(
            n, seed=seed, rank=rank, world_size=world_size, start=start * batch_size, repeats=self.repeats
        )
        sampler.set_epoch(epoch)
        loader = self.source.loader(
            sampler, batch_size=batch_size, device=device, seed=mix_seed(seed, epoch, rank, start)
        )
        for images, labels in loader:
            yield _on_device(images, labels, device, self.recipe)

    def init_batch(self, *, batch_size, seed, world_size, device) -> Batch | None:
        """Rank 0's first batch of epoch 0 for a Dataset (every rank computes it alike); an iterable's first."""
        batches = self.batches(
            epoch=0, batch_size=batch_size, seed=seed, rank=0, world_size=world_size, device=device, generator=None
        )
        return next(iter(batches), None)

    def evaluate(self, model, *, split="test", batch_size, device, dist) -> dict:
        source = self.val if split == "val" else self.test
        if source is None:
            raise DatasetError(f"no {split} data")
        batches = self.eval_batches(source, batch_size, device, dist)
        return evaluate_batches(model, batches, device=device, dist=dist, lengths=True)

    def eval_batches(self, source: Source, batch_size: int, device: torch.device, dist) -> Iterator[Batch]:
        """A Dataset in order, rank r taking every world_size-th example; an iterable as it is (each rank its own)."""
        if not source.indexed:
            for images, labels in source.passes(0):
                yield _on_device(images, labels, device, self.recipe)
            return
        sampler = _Shard(len(source.data), dist.rank, dist.world_size)
        for images, labels in source.loader(sampler, batch_size=batch_size, device=device, seed=0):
            yield _on_device(images, labels, device, self.recipe)
