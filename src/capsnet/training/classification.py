"""The classification task (§4, §5): a data set by name, its splits, augmentation and device copies."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ..configs.base import parse_size
from ..data.batching import epoch_indices, iterate_batches, num_batches
from ..data.colour import colour_check
from ..data.datasets import load_dataset
from ..data.imageaug import OWN_KINDS, AugmentSpec, resolve_augment
from ..data.scaling import channel_stats
from ..data.split import Split, stratified_holdout
from ..errors import ConfigError, DatasetError
from ..models.recipe import recipe_for
from ..pixels import to_float
from .evaluator import evaluate
from .recipes import model_recipes, recipe_image_size
from .tasks import Batch, Task


def subset(split: Split, n: int | None) -> Split:
    return split if n is None else Split(split.images[:n], split.labels[:n])


def validation_split(train: Split, official: Split | None, config) -> tuple[Split, Split | None, dict[str, Any]]:
    """(training split, validation split or None, what config.json records of it) for a TrainConfig's
    val_fraction and val_seed: the data set's official validation split where it has one, else a stratified,
    seeded hold-out of `train` (`capsnet.data.split.stratified_holdout`); none at val_fraction 0."""
    fraction = float(getattr(config, "val_fraction", 0.0))
    seed = int(getattr(config, "val_seed", 0))
    if fraction == 0:
        return train, None, {"source": "none"}
    if official is not None:
        return train, official, {"source": "official", "n": len(official)}
    kept, held = stratified_holdout(train, fraction, seed=seed)
    return kept, held, {"source": "held out of the training split", "fraction": fraction, "seed": seed, "n": len(held)}


class ClassificationTask(Task):
    """One digit per image, labels [B]; the paper's shift augmentation (§5: up to 2 px; the
    shifted-in pixels take the image's border colour, 0 on MNIST: capsnet.data.augment.random_shift)."""

    name = "classification"
    repeatable = True

    def __init__(
        self,
        *,
        train: Split,
        test: Split,
        val: Split | None = None,
        n_classes: int = 10,
        shift: int = 2,
        source: str = "data",
        augment: AugmentSpec | None = None,
        class_names: tuple[str, ...] = (),
        digits: bool = False,
    ):
        _, channels, height, width = train.images.shape
        self.train, self.test, self.val, self.shift = train, test, val, shift
        # The training augmentation (default: the paper's shift) and what the model records of the data.
        self.spec = augment if augment is not None else AugmentSpec(shift=shift)
        h, w = self.spec.output_size(height, width)  # the model's input: the (random / centre) crop
        self.in_channels, self.image_size, self.n_classes = channels, (h if h == w else (h, w)), n_classes
        self.class_names, self.digits = tuple(class_names), digits
        self.source_size = (height, width) if (h, w) != (height, width) else ()
        # raw images -> the model's input values (÷ 255, the spec's divisor, or the training split's statistics)
        stats = channel_stats(train) if self.spec.channel_standardize else None
        self.recipe = recipe_for(
            divisor=self.spec.divisor,
            channel_standardize=self.spec.channel_standardize,
            stats=stats,
            channels=channels,
            size=(h, w),
            n_classes=n_classes,
            source_size=self.source_size,
            digits=digits,
        )
        validation = {"source": "given", "n": len(val)} if val is not None else {"source": "none"}
        self.recorded: dict[str, Any] = {"augment": str(self.spec), "validation": validation}
        self._resident: dict[tuple[str, str], Split | None] = {}  # (split, device) -> its copy there, or None

    @classmethod
    def from_config(cls, config) -> ClassificationTask:
        """Build from a TrainConfig's dataset, data_dir, train_subset, test_subset and shift."""
        # Image folders' options (a single folder's held-out split uses a fixed seed, the same for every run).
        names = {
            "image_size": "image_size",
            "channels": "image_channels",
            "test_fraction": "test_fraction",
            "strict": "strict",
        }
        options = {key: getattr(config, attr, None) for key, attr in names.items()}
        recipes = model_recipes(getattr(config, "model", None))  # the model's own pipelines (`--augment auto`)
        options["image_size"] = recipe_image_size(config, recipes)
        data = load_dataset(config.dataset, data_dir=config.data_dir, **{k: v for k, v in options.items() if v})
        if data.train is None:
            raise DatasetError(f"{data.source}: holds only a test split; training needs the train-* files too")
        check_image_size(getattr(config, "image_size", None), data)
        augment, kind = getattr(config, "augment", "auto"), data.kind or "idx"
        train, val, recorded = validation_split(subset(data.train, config.train_subset), data.val, config)
        # The formats of a user's own data (an image folder, a .npz): no recorded recipe chose their augmentation or
        # sized their epochs, so `auto` looks at the training split's colours, and an unset epoch_repeats lengthens
        # a small one's epochs (capsnet.training.config.MIN_EPOCH_STEPS).
        own = kind in OWN_KINDS
        colours = colour_check(train) if own and augment == "auto" else None
        spec = resolve_augment(augment, kind, shift=config.shift, recipes=recipes, colours=colours)
        if spec.flip and data.digits:
            raise DatasetError(f"{data.source}: a digit set; flipping digits changes their class (drop 'flip')")
        task = cls(
            train=train,
            test=subset(data.test, config.test_subset),
            val=val,
            n_classes=data.n_classes,
            shift=config.shift,
            source=data.source,
            augment=spec,
            class_names=data.class_names,
            digits=data.digits,
        )
        task.recorded["validation"] = recorded
        task.own_data = own
        if colours is not None and spec.colour:
            task.notes = (f"augment: {spec}, since {colours.line()} (set --augment to change)",)
        return task

    @property
    def has_val(self) -> bool:
        return self.val is not None

    def model_fields(self) -> dict:
        """The data fields of the model's config: input size (after the crop), channels, classes, and what the
        model records of the data (standardization, class names, digit set, size before cropping)."""
        return {
            **super().model_fields(),
            "standardize": self.spec.standardize,
            "class_names": self.class_names,
            "source_size": self.source_size,
        }

    def num_batches(self, *, batch_size: int, world_size: int) -> int:
        return num_batches(len(self.train) * self.repeats, batch_size=batch_size, world_size=world_size)

    def on_device(self, which: str, device: torch.device) -> Split | None:
        """The "train", "val" or "test" split, moved to `device` once (uint8: 47 MB for MNIST's training set) when it
        fits (`fits_on_device`, asked before anything is copied); None when it does not."""
        key = (which, str(device))
        if key not in self._resident:
            split = getattr(self, which)
            fits = fits_on_device(split.images.nbytes + split.labels.nbytes, device)
            self._resident[key] = (
                Split(split.images.to(device), split.labels.to(device), split.channel_stats) if fits else None
            )
        return self._resident[key]

    def batches(self, *, epoch, batch_size, seed, rank, world_size, device, generator, start=0) -> Iterator[Batch]:
        device = torch.device(device)
        opts = {"shuffle": True, "seed": seed, "epoch": epoch, "rank": rank, "world_size": world_size}
        opts |= {"repeats": self.repeats}  # (the epoch's passes: capsnet.training.config.settle_epoch_repeats)
        resident = self.on_device("train", device)
        if resident is not None:  # gather, convert and augment on the device
            it = iterate_batches(resident, batch_size=batch_size, device=device, **opts)
            it = itertools.islice(it, start, None)
        else:  # too large for the device: gathered on the host into pinned buffers, copied while the device computes
            idx = epoch_indices(len(self.train), **opts)[start * batch_size :]
            it = staged_batches(self.train, idx, batch_size=batch_size, device=device)
        # Skipped batches (a resumed epoch) draw no random numbers: the generator state was restored instead.
        for images, labels in it:
            yield self.make_batch(images, labels, generator)

    def make_batch(self, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator) -> Batch:
        """A training batch from raw images [B, C, H, W] on the device (uint8, or floats in [0, 1]): the recipe's
        values (before the random crops, which it commutes with), then the augmentation. The eager batches and the
        graph-captured step (capsnet.training.graphs) both make theirs here."""
        return Batch(self.augment(self.recipe.scale(to_float(images)), generator), labels)

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The training augmentation (`capsnet.data.imageaug.AugmentSpec`; by default the paper's random
        shift, §5)."""
        return self.spec(images, generator)

    def evaluate(self, model, *, split="test", batch_size, device, dist) -> dict:
        if split not in ("val", "test") or getattr(self, split) is None:
            raise DatasetError(f"this task has no {split!r} split")
        data = self.on_device(split, torch.device(device)) or getattr(self, split)
        return evaluate(model, data, batch_size=batch_size, device=device, dist=dist)


def check_image_size(given: str | None, data) -> None:
    """ConfigError unless an `--image-size` given applies: its reader resized the images to it (image folders,
    smallNORB); a reader that keeps its files' size (IDX, CIFAR, SVHN, .npz) cannot take one."""
    if not given:
        return
    want = parse_size(given)
    got = tuple(data.train.images.shape[-2:])
    if want is not None and tuple(want) != got:
        reader = data.kind or "this format"
        raise ConfigError(
            f"--image-size {given}: {data.name}'s images are {got[0]}x{got[1]} and its reader "
            f"({reader}) does not resize them; drop --image-size"
        )


# --------------------------------------------------------------------------------------- data on the device
DEVICE_DATA_FRACTION = 0.25  # a split moves to an accelerator when it takes at most this share of its free memory


def fits_on_device(nbytes: int, device: torch.device) -> bool:
    """Whether a split of `nbytes` should live on `device`: always on the CPU (it is there already); on CUDA when it
    takes at most DEVICE_DATA_FRACTION of the free memory, leaving the rest to the model and its activations."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return nbytes <= DEVICE_DATA_FRACTION * free
    return False


def staged_batches(split: Split, idx: torch.Tensor, *, batch_size: int, device: torch.device, depth: int = 2):
    """(images float [B, C, H, W] in [0, 1], labels [B]) on `device` for the examples `idx` of a host-resident split.

    Each uint8 batch is gathered on the host into one of `depth` page-locked (pinned) buffers and copied with
    non_blocking=True: the copy runs while the device still computes the previous step, and the host gathers the
    next batch meanwhile. A buffer is reused only once its copy has finished (a CUDA event, `depth` batches old).
    """
    pinned = device.type == "cuda"
    shape = (batch_size, *split.images.shape[1:])
    images = [torch.empty(shape, dtype=split.images.dtype, pin_memory=pinned) for _ in range(depth)]
    labels = [torch.empty(batch_size, dtype=split.labels.dtype, pin_memory=pinned) for _ in range(depth)]
    copied: list = [None] * depth
    for k, lo in enumerate(range(0, len(idx), batch_size)):
        take, slot = idx[lo : lo + batch_size], k % depth
        if copied[slot] is not None:
            copied[slot].synchronize()  # the copy out of this buffer, `depth` batches ago
        x, y = images[slot][: len(take)], labels[slot][: len(take)]
        torch.index_select(split.images, 0, take, out=x)
        torch.index_select(split.labels, 0, take, out=y)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if pinned:
            copied[slot] = torch.cuda.Event()
            copied[slot].record()
        yield to_float(x), y
