"""What `capsnet train` is told: the training config (its flags are generated from the fields), and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import ConfigError
from ..models.registry import MODELS, model_class


@dataclass
class TrainConfig:
    """How to train; the model's own options live in its config (e.g. :class:`capsnet.CapsNetConfig`)."""

    dataset: str = field(
        default="mnist-sample",
        metadata={"help": "a known data set (mnist, cifar10, svhn, smallnorb, ...), a folder (IDX, CIFAR, SVHN or "
                  "smallNORB files, or class folders of images) or a .npz"},
    )  # fmt: skip
    data_dir: str | None = field(default=None, metadata={"help": "folder holding the data set's files"})
    train_subset: int | None = field(default=None, metadata={"help": "use only the first N training images"})
    test_subset: int | None = field(default=None, metadata={"help": "evaluate on the first N test images only"})
    shift: int = field(default=2, metadata={"help": "random translation of up to N pixels (paper: 2)"})
    augment: str = field(
        default="auto",
        metadata={
            "help": "training augmentation: auto (the model recipe's where it has one, else the data set's default "
            "shown by `capsnet data info`), none, "
            "or a comma list of shift=N, crop=H[xW], flip, brightness=D, contrast=LO:HI, rotate=DEG, zoom=LO:HI, "
            "standardize, hvc (Byerly et al.'s; hvc-capsnet's default on MNIST-format sets)"
        },
    )
    image_size: str | None = field(
        default=None, metadata={"help": "image folders: convert every image to H or HxW (default: the most common)"}
    )
    image_channels: int | None = field(
        default=None, metadata={"help": "image folders: 1 (greyscale) or 3 (RGB) (default: the most common mode)"}
    )
    val_fraction: float = field(
        default=0.1, metadata={"help": "one image folder of classes: the share of each class held out for testing"}
    )
    strict: bool = field(
        default=False, metadata={"help": "image folders: an unreadable file is an error instead of a warning"}
    )
    epochs: int = field(default=10, metadata={"help": "number of epochs"})
    batch_size: int | None = field(
        default=None,
        metadata={
            "help": "images per step, per process; if unset, the model's recipe (hvc-capsnet: 120), else 16 on "
            "CPU and 128 on CUDA"
        },
    )
    lr: float | None = field(
        default=None, metadata={"help": "Adam learning rate; if unset, the model's (CapsNet 1e-3, baseline CNN 1e-4)"}
    )
    lr_decay: float | None = field(
        default=None,
        metadata={"help": "learning rate factor applied after every epoch; if unset, lr_end^(1/(epochs-1))"},
    )
    lr_end: float = field(
        default=0.25, metadata={"help": "without --lr-decay, the last epoch trains at lr x lr_end (3 epochs: x0.5)"}
    )
    eval_batch_size: int = field(default=250, metadata={"help": "images per evaluation batch"})
    seed: int = field(default=0, metadata={"help": "seed for initialisation, shuffling and augmentation"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:K"})
    precision: Literal["fp32", "bf16"] = field(default="fp32", metadata={"help": "bf16 runs under autocast"})
    channels_last: bool = field(default=False, metadata={"help": "channels-last memory format for the convolutions"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    out: str = field(default="runs/capsnet", metadata={"help": "run folder for checkpoints and metrics"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out from its last checkpoint"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard scalars when installed"})
    model: str = field(default="capsnet", metadata={"help": f"the network: {', '.join(MODELS)}"})

    def __post_init__(self) -> None:
        model_class(self.model)  # a ConfigError naming the known models
        for name in ("epochs", "batch_size", "eval_batch_size", "train_subset", "test_subset"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shift < 0:
            raise ConfigError(f"shift must be >= 0, got {self.shift}")
        lr_ok = self.lr is None or self.lr > 0
        if not (lr_ok and 0 < self.lr_end <= 1 and (self.lr_decay is None or 0 < self.lr_decay <= 1)):
            raise ConfigError("need lr > 0, 0 < lr_decay <= 1 and 0 < lr_end <= 1")

    @property
    def learning_rate(self) -> float:
        """The Adam learning rate: `lr` if given, else the model's own default (`default_lr` of its class)."""
        return self.lr if self.lr is not None else MODELS[self.model].default_lr

    @property
    def decay_per_epoch(self) -> float:
        """The exponential decay's factor per epoch: `lr_decay` if given, else the factor that brings the last
        epoch's learning rate to lr × lr_end, so the schedule stretches with `epochs` (1 epoch: no decay)."""
        if self.lr_decay is not None:
            return self.lr_decay
        model_decay = getattr(MODELS[self.model], "default_lr_decay", None)  # a paper's own recipe (Efficient-CapsNet)
        if model_decay is not None:
            return model_decay
        return self.lr_end ** (1.0 / (self.epochs - 1)) if self.epochs > 1 else 1.0


@dataclass
class TrainResult:
    run_dir: Path
    epochs_done: int
    best_test_acc: float
    history: list[dict[str, float]]
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped the run, if one did
    is_main: bool = True  # rank 0 (or a single process): the one that reports


# Model options that come from the data set rather than from flags.
DATA_FIELDS = ("in_channels", "image_size", "n_classes", "standardize", "class_names", "digits", "source_size")
