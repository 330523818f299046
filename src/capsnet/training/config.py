"""What training is told and returns: a LoopConfig base, TrainConfig, FitConfig; TrainResult."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..configs.base import (
    MODEL_CONFIGS,
    parse_size,
)
from ..errors import ConfigError, DatasetError
from .selection import DEFAULT_MONITOR, Monitor, check_decay

LR_END = 0.25  # the last epoch's share of the learning rate when neither a decay nor lr_end is given
# The fewest optimizer steps an epoch of one's own data takes when epoch_repeats is unset: every recipe decays its
# learning rate per epoch as on tens of thousands of images, and 270 images at batch 16 give 17 steps an epoch
# (docs/training.md, "What learns a folder of one's own").
MIN_EPOCH_STEPS = 200


def min_epoch_steps(model_class: Any) -> int:
    """The fewest optimizer steps an epoch of one's own data takes for a model of `model_class`: its
    `own_data_epoch_steps` where it sets one (capsnet.models.pretrained.Pretrained), else MIN_EPOCH_STEPS."""
    steps = getattr(model_class, "own_data_epoch_steps", None)
    if steps is None:
        return MIN_EPOCH_STEPS
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"{model_class.__name__}.own_data_epoch_steps is {steps!r}: need a whole number, 1 or more")
    return steps


def own_data_options(model_class: Any) -> dict[str, Any]:
    """The config values a model of `model_class` takes on one's own data where the caller sets none: its
    `own_data_options` (capsnet.models.pretrained.Pretrained), each a field of its config class."""
    options = getattr(model_class, "own_data_options", None)
    if options == {} or options is None:
        return {}
    config_class = getattr(model_class, "config_class", None)
    fields = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    if not isinstance(options, dict) or not set(options) <= fields:
        name = getattr(config_class, "__name__", "its config_class")
        raise ConfigError(f"{model_class.__name__}.own_data_options is {options!r}: need a dict of fields of {name}")
    return dict(options)


@dataclass(kw_only=True)
class LoopConfig:
    """How the training loop runs, shared by `capsnet train` (TrainConfig) and `capsnet.fit` (FitConfig); recorded as
    the run's "train" settings in config.json. The model's own options live in its config (e.g.
    `capsnet.CapsNetConfig`)."""

    epochs: int = field(default=10, metadata={"help": "number of epochs"})
    epoch_repeats: int | None = field(
        default=None,
        metadata={
            "help": f"passes over the training images in one epoch (timm's --epoch-repeats); unset: 1 on a data "
            f"set with a recorded recipe (MNIST, the sample, CIFAR, ...), and on an image folder, a .npz or a "
            f"Dataset of one's own the fewest that make an epoch {MIN_EPOCH_STEPS} steps or more (some models more: "
            f"own_data_epoch_steps in `capsnet models --json`)"
        },
    )
    batch_size: int | None = field(
        default=None,
        metadata={
            "help": "images per step, per process; if unset, the model's recipe (hvc-capsnet: 120), else 16 on "
            "CPU and 128 on CUDA"
        },
    )
    eval_batch_size: int = field(default=250, metadata={"help": "images per evaluation batch"})
    lr: float | None = field(
        default=None, metadata={"help": "Adam learning rate; if unset, the model's (CapsNet 1e-3, baseline CNN 1e-4)"}
    )
    lr_decay: float | None = field(
        default=None,
        metadata={
            "help": "learning rate factor applied after every epoch (or give --lr-end); if neither is set, the "
            "model's own decay where its recipe has one, else --lr-end 0.25"
        },
    )
    lr_end: float | None = field(
        default=None,
        metadata={
            "help": "the last epoch trains at lr x lr_end, the decay stretched over --epochs (0.25 over 3 "
            "epochs: x0.5 each); overrides the model's own decay; not with --lr-decay"
        },
    )
    val_fraction: float = field(
        default=0.1,
        metadata={
            "help": "share of the training images held out for validation (stratified, seeded by --val-seed): "
            "best/ is chosen on it by --monitor and the test split is scored once, at the end; 0.2-0.3 "
            "resolves late epochs better than the default on a small set (docs/training.md); 0 chooses best/ "
            "on the test set (the figure is then a maximum over epochs)"
        },
    )
    val_seed: int = field(default=0, metadata={"help": "seed of the validation hold-out (the same for every --seed)"})
    monitor: str | None = field(
        default=None,
        metadata={
            "help": f"what chooses best/ on the validation split: val_loss, val_accuracy, or a comma list "
            f"compared in order (val_accuracy,val_loss: the loss breaks accuracy's ties); unset: "
            f"{DEFAULT_MONITOR}"
        },
    )
    stop_at_val_acc: float | None = field(
        default=None,
        metadata={
            "help": "stop after the first epoch whose validation accuracy reaches this (e.g. 1.0; Lightning's "
            "stopping_threshold), before --epochs; best/ and the test split as at the run's end; needs a "
            "validation split; 0: never (on --resume, a run recorded with a threshold trains on to --epochs)"
        },
    )
    ema: float | None = field(
        default=None,
        metadata={
            "help": "keep an exponential moving average of the weights with this decay (e.g. 0.999), "
            "scored on validation beside the raw weights each epoch; best/ may be either"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for initialisation, shuffling and augmentation"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:K"})
    precision: Literal["fp32", "bf16"] = field(default="fp32", metadata={"help": "bf16 runs under autocast"})
    channels_last: bool = field(default=False, metadata={"help": "channels-last memory format for the convolutions"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    cuda_graphs: bool = field(
        default=False,
        metadata={
            "help": "CUDA: capture the whole training step (batch gather and augmentation, forward, backward, "
            "Adam) as one CUDA graph and replay it; the epoch's last, smaller batch runs eagerly; where it "
            "cannot be captured, one line and eager training"
        },
    )
    cudnn_benchmark: bool | None = field(
        default=None,
        metadata={
            "help": "CUDA: let cuDNN time its convolution algorithms for each new input shape "
            "(torch.backends.cudnn.benchmark); unset: the session's setting (PyTorch's default: off)"
        },
    )
    out: str = field(default="runs/capsnet", metadata={"help": "run folder for checkpoints and metrics"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out from its last checkpoint"})
    overwrite: bool = field(
        default=False, metadata={"help": "delete the run already in --out and start afresh (not with --resume)"}
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard scalars when installed"})
    model: str = field(default="", metadata={"help": "what is trained: a registered model's name"})

    def __post_init__(self) -> None:
        self.out = str(self.out)
        for name in ("epochs", "epoch_repeats", "batch_size", "eval_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}")
        check_schedule(self.lr, self.lr_decay, self.lr_end)
        if self.monitor is not None:
            Monitor.parse(self.monitor)
        if self.stop_at_val_acc is not None and not 0 <= self.stop_at_val_acc <= 1:
            raise ConfigError(f"stop_at_val_acc must be in [0, 1] (0: never stop early), got {self.stop_at_val_acc}")
        check_decay(self.ema)
        if self.overwrite and self.resume:
            raise ConfigError("overwrite deletes the run that resume would continue: give one of them")

    @property
    def learning_rate(self) -> float:
        """The Adam learning rate: `lr` if given, else 1e-3."""
        return self.lr if self.lr is not None else 1e-3

    @property
    def decay_per_epoch(self) -> float:
        """`lr_decay` if given, else the factor that brings the last epoch's learning rate to lr × lr_end."""
        return decay_per_epoch(self.lr_decay, self.lr_end, self.epochs)


@dataclass(kw_only=True)
class TrainConfig(LoopConfig):
    """How `capsnet train` trains: the loop's settings, and the data set and model by name (its flags are generated
    from the fields)."""

    dataset: str = field(
        default="mnist-sample",
        metadata={
            "help": "a known data set (mnist, cifar10, svhn, smallnorb, ...), a folder (IDX, CIFAR, SVHN or "
            "smallNORB files, or class folders of images) or a .npz"
        },
    )
    data_dir: str | None = field(default=None, metadata={"help": "folder holding the data set's files"})
    train_subset: int | None = field(default=None, metadata={"help": "use only the first N training images"})
    test_subset: int | None = field(default=None, metadata={"help": "evaluate on the first N test images only"})
    shift: int = field(default=2, metadata={"help": "random translation of up to N pixels (paper: 2)"})
    augment: str = field(
        default="auto",
        metadata={
            "help": "training augmentation: auto (the model recipe's where it has one, else the data set's default "
            "shown by `capsnet data info`), none, or a comma list of shift=N, crop=H[xW], flip, colour, "
            "brightness=D, contrast=LO:HI, rotate=DEG, zoom=LO:HI, standardize, hvc (Byerly et al.'s; "
            "hvc-capsnet's default on MNIST-format sets)"
        },
    )
    image_size: str | None = field(
        default=None,
        metadata={
            "help": "image folders: convert every image to H or HxW (default: the most common); smallNORB: "
            "its side (default 48, or the model's recipe: Efficient-CapsNet 64)"
        },
    )
    image_channels: int | None = field(
        default=None, metadata={"help": "image folders: 1 (greyscale) or 3 (RGB) (default: the most common mode)"}
    )
    test_fraction: float = field(
        default=0.1, metadata={"help": "one image folder of classes: the share of each class held out for testing"}
    )
    strict: bool = field(
        default=False, metadata={"help": "image folders: an unreadable file is an error instead of a warning"}
    )
    model: str = field(
        default="capsnet",
        metadata={
            "help": f"the network: {', '.join(MODEL_CONFIGS)}, or an installed plugin's (entry point group "
            "capsnet.models; `capsnet models` lists them)"
        },
    )

    def __post_init__(self) -> None:
        from ..models.registry import MODELS  # (torch: the parser reads these fields without it)

        super().__post_init__()
        self.model = MODELS.canonical(self.model)  # an alias (e.g. baseline-cnn) names its model; else ConfigError
        for name in ("train_subset", "test_subset"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shift < 0:
            raise ConfigError(f"shift must be >= 0, got {self.shift}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.image_channels not in (None, 1, 3):
            raise ConfigError(f"image_channels must be 1 (greyscale) or 3 (RGB), got {self.image_channels}")
        try:
            parse_size(self.image_size)
        except DatasetError as e:
            raise ConfigError(str(e)) from None

    @property
    def learning_rate(self) -> float:
        """The Adam learning rate: `lr` if given, else the model's own default (`default_lr` of its class)."""
        from ..models.registry import MODELS

        return self.lr if self.lr is not None else MODELS[self.model].default_lr

    @property
    def decay_per_epoch(self) -> float:
        """The exponential decay's factor per epoch: `lr_decay` if given; else, with `lr_end` given, the factor
        that brings the last epoch's learning rate to lr × lr_end, so the schedule stretches with `epochs` (1
        epoch: no decay); else the model's own (`default_lr_decay`, a paper's recipe), else lr_end LR_END."""
        from ..models.registry import MODELS  # (torch: the parser reads these fields without it)

        model_decay = getattr(MODELS[self.model], "default_lr_decay", None)  # (Efficient-CapsNet, HVC)
        if self.lr_decay is None and self.lr_end is None and model_decay is not None:
            return model_decay
        return decay_per_epoch(self.lr_decay, self.lr_end, self.epochs)


@dataclass(kw_only=True)
class FitConfig(LoopConfig):
    """How `capsnet.fit` trains: the loop's settings (the data and the model are given as objects). `lr` None is
    1e-3 (capsnet.fit gives the model's default_lr, or a resumed run's own)."""

    epochs: int
    out: str
    workers: int = 0  # DataLoader worker processes reading a Dataset
    # Not keywords of capsnet.fit (`internal`): the batches of a Dataset or DataLoader are not capturable, so
    # always eager; cuDNN keeps the session's setting.
    cuda_graphs: bool = field(default=False, metadata={"internal": True})
    cudnn_benchmark: bool | None = field(default=None, metadata={"internal": True})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")


def check_schedule(lr: float | None, lr_decay: float | None, lr_end: float | None) -> None:
    """ConfigError for a learning rate or schedule out of range, or for both lr_decay and lr_end: each sets the
    decay per epoch, so an explicit one wins over a model's own decay and the two together are a conflict."""
    if lr_decay is not None and lr_end is not None:
        raise ConfigError(
            f"lr_decay {lr_decay:g} and lr_end {lr_end:g} both set the learning rate's decay: give one "
            "(--lr-decay, a factor per epoch, or --lr-end, the last epoch's share of lr)"
        )
    if not ((lr is None or lr > 0) and (lr_end is None or 0 < lr_end <= 1) and (lr_decay is None or 0 < lr_decay <= 1)):
        raise ConfigError("need lr > 0, 0 < lr_decay <= 1 and 0 < lr_end <= 1")


def resolve_epoch_repeats(
    given: int | None, *, steps: Callable[[int], int] | None, own_data: bool, min_steps: int = MIN_EPOCH_STEPS
) -> int:
    """LoopConfig.epoch_repeats as a number: `given` if set; else, on one's own data whose epoch of r passes takes
    `steps(r)` optimizer steps, the fewest passes that make `min_steps` steps (the model's: `min_epoch_steps`);
    else 1."""
    if given is not None:
        return given
    if not own_data or steps is None or steps(1) == 0:
        return 1
    repeats = -(-min_steps // steps(1))  # (a lower bound: a pass's last batch may be a partial one)
    while steps(repeats) < min_steps:
        repeats += 1
    return repeats


def settle_epoch_repeats(
    config: Any, task: Any, *, world_size: int, flag: str = "--epoch-repeats", min_steps: int = MIN_EPOCH_STEPS
) -> tuple[Any, str | None]:
    """(the config with epoch_repeats a number, set on `task` too; the line announcing one chosen for the user,
    else None), at least `min_steps` steps an epoch on one's own data. ConfigError for repeats given to a task whose
    data cannot repeat (an iterable of batches)."""
    given = config.epoch_repeats
    if not task.repeatable:
        if given is not None and given > 1:
            raise ConfigError(f"epoch_repeats {given}: this training data cannot repeat within an epoch; give 1")
        return dataclasses.replace(config, epoch_repeats=1), None
    batch_size = config.batch_size
    assert batch_size is not None  # (resolved by capsnet.training.hardware.device_settings)

    def steps(repeats: int) -> int:  # an epoch's optimizer steps at `repeats` passes
        task.repeats = repeats
        return task.num_batches(batch_size=batch_size, world_size=world_size)

    repeats = resolve_epoch_repeats(given, steps=steps, own_data=task.own_data, min_steps=min_steps)
    note = None
    if given is None and repeats > 1:
        note = (
            f"epoch: {repeats} passes over the training images, {steps(repeats)} steps (at least "
            f"{min_steps} on data of one's own; set {flag} to change)"
        )
    task.repeats = repeats
    return dataclasses.replace(config, epoch_repeats=repeats), note


def decay_per_epoch(lr_decay: float | None, lr_end: float | None, epochs: int) -> float:
    """`lr_decay`, else the factor that takes the learning rate to lr × lr_end (LR_END if None) in the last epoch."""
    if lr_decay is not None:
        return lr_decay
    end = lr_end if lr_end is not None else LR_END
    return end ** (1.0 / (epochs - 1)) if epochs > 1 else 1.0


@dataclass
class TrainResult:
    """What a run did. `best` is {"epoch", "step", "metric", "value"}: the epoch best/ holds and the figure it was
    chosen on (the monitor's: "val_loss" by default, "val_acc" with val_accuracy; "test_*" without a validation split;
    "train_loss" with neither). `test`
    is the run's test.json once it has finished: {"selected_on", "best": {"epoch", "accuracy", "loss", "n"},
    "last": {...}}; None before."""

    run_dir: Path
    epochs_done: int
    history: list[dict[str, float]]
    best: dict[str, Any] = field(default_factory=dict)
    test: dict[str, Any] | None = None
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped the run, if one did
    is_main: bool = True  # rank 0 (or a single process): the one that reports

    @property
    def best_test_acc(self) -> float | None:
        """The test accuracy of best/ (the validation-chosen checkpoint), once the run has finished."""
        return self.test.get("best", self.test["last"])["accuracy"] if self.test else None
