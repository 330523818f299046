"""What the model configs share, torch-free: the recorded-data fields every model config inherits, EM routing's
constants, the shape arithmetic their checks use, and the registry of model configs by model name.

May import: the foundation modules only (errors, limits). Every layer may import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, DatasetError
from ..limits import MAX_IMAGE_SIDE

FINAL_LAMBDA = 0.01  # λ_final: the authors' value (OpenReview reply; Gritzman 2019)
# EM routing's σ² floor where capsnet trains it: 1e-2, not the official code's 5e-4 (routing.em.MIN_VAR): the gradient
# through the E-step grows as 1/σ², and on the bundled sample r = 3 learned only with the larger floor
# (docs/benchmarks.md, EM routing).
TRAINED_MIN_VAR = 1e-2


@dataclass(kw_only=True)
class RecordedData:
    """Config fields that describe the data a model was trained on rather than its architecture: the training
    task (capsnet.training.tasks.Task) fills them in from the data set, and predict, evaluate and visualize read them.
    A model config inherits them (keyword-only, so its own fields keep their positions) and calls
    `_check_recorded(n_classes)` in its `__post_init__`."""

    standardize: bool = field(
        default=False, metadata={"help": "per-image standardization of the input; set from the data set's augmentation"}
    )
    class_names: tuple[str, ...] = field(default=(), metadata={"help": "the training data's class names"})
    digits: bool = field(
        default=False,
        metadata={
            "help": "raw images are digit-style ink images (white on black in a 20/28 box): predict converts "
            "image files so; set from the data set (capsnet.fit: its digits argument)"
        },
    )
    source_size: tuple[int, ...] = field(
        default=(), metadata={"help": "[H, W] of the training images before cropping (empty: image_size)"}
    )
    # The model's input recipe (capsnet.models.recipe): uint8 pixels p become p / input_divisor, or, with
    # channel_standardize, (p − mean_c) / std_c with the statistics of the split being read.
    input_divisor: float = field(
        default=255.0, metadata={"help": "uint8 pixels are divided by this; set from the data set's augmentation"}
    )
    channel_standardize: bool = field(
        default=False,
        metadata={
            "help": "per-channel standardization with the statistics of the split read (evaluate) or of the "
            "training split (channel_mean, channel_std: single images); set from the augmentation"
        },
    )
    channel_mean: tuple[float, ...] = field(
        default=(), metadata={"help": "the training split's per-channel pixel mean (with channel_standardize)"}
    )
    channel_std: tuple[float, ...] = field(
        default=(), metadata={"help": "the training split's per-channel pixel std (with channel_standardize)"}
    )

    def _check_recorded(self, n_classes: int) -> None:
        """Lists from config.json become tuples; one class name per class; a positive divisor and stds."""
        self.class_names, self.source_size = tuple(self.class_names), tuple(self.source_size)
        self.channel_mean, self.channel_std = tuple(self.channel_mean), tuple(self.channel_std)
        if self.class_names and len(self.class_names) != n_classes:
            raise ConfigError(f"{len(self.class_names)} class_names for n_classes {n_classes}")
        if not self.input_divisor > 0 or any(not s > 0 for s in self.channel_std):
            raise ConfigError("input_divisor and channel_std must be > 0")
        if len(self.channel_mean) != len(self.channel_std):
            raise ConfigError(f"{len(self.channel_mean)} channel_mean values for {len(self.channel_std)} channel_std")


# The config fields that come from the training data rather than from the user: the input's shape and classes,
# and RecordedData's. Training fills them in from the data set; a pretrained model keeps the ones it was saved with.
DATA_FIELDS = (
    "in_channels",
    "image_size",
    "n_classes",
    "standardize",
    "class_names",
    "digits",
    "source_size",
    "input_divisor",
    "channel_standardize",
    "channel_mean",
    "channel_std",
)

# What a config.json written before a RecordedData field existed meant by its absence: `digits` then defaulted to
# true (every such run was trained on a digit set or recorded the field).
RECORDED_SAVED_DEFAULTS = {"digits": True}


def image_hw(size: int | tuple[int, ...] | list[int]) -> tuple[int, int]:
    """A config's `image_size` as (height, width): an int is a square side, a pair is [height, width]."""
    if isinstance(size, int):
        return size, size
    height, width = size
    return int(height), int(width)


def parse_size(text: str | int | tuple[int, int] | list[int] | None) -> tuple[int, int] | None:
    """ "32" -> (32, 32); "48x64" -> (48, 64) (H×W); ints and pairs pass through."""
    if text is None:
        return None
    if isinstance(text, int):
        size: tuple[int, ...] = (text, text)
    elif isinstance(text, (tuple, list)):
        size = tuple(int(v) for v in text) * (2 if len(text) == 1 else 1)
    else:
        try:
            parts = [int(v) for v in str(text).lower().replace("×", "x").split("x")]
        except ValueError:
            raise DatasetError(f"image size {text!r}: expected H or HxW, e.g. 32 or 48x64") from None
        size = tuple(parts) * (2 if len(parts) == 1 else 1)
    if len(size) != 2 or min(size) < 1:
        raise DatasetError(f"image size {text!r}: expected H or HxW with positive sides")
    if max(size) > MAX_IMAGE_SIDE:
        raise DatasetError(f"image size {text!r}: sides are limited to {MAX_IMAGE_SIDE} pixels (MAX_IMAGE_SIDE)")
    return size


def conv_output_size(size: int, kernel_size: int, stride: int = 1, padding: int = 0) -> int:
    """Side of a convolution's output: ⌊(size + 2·padding - kernel_size) / stride⌋ + 1 (< 1: the input is too small).

    With padding = kernel_size // 2 (odd kernels: "same") this is ⌈size / stride⌉, as TensorFlow's SAME padding."""
    return (size + 2 * padding - kernel_size) // stride + 1


def check_loss_options(config: Any) -> None:
    """ConfigError unless a config's decoder and loss options are usable: positive `decoder_hidden` sizes, a finite
    `recon_weight` >= 0 and a `router_init_std` (when set) > 0."""
    if min((*config.decoder_hidden, 1)) < 1:
        raise ConfigError(f"decoder_hidden sizes must be >= 1, got {list(config.decoder_hidden)}")
    if not math.isfinite(config.recon_weight) or config.recon_weight < 0:
        raise ConfigError(f"recon_weight must be a number >= 0, got {config.recon_weight}")
    std = config.router_init_std
    if std is not None and not (math.isfinite(std) and std > 0):
        raise ConfigError(f"router_init_std must be > 0, got {std}")


def check_capsule_layers(config: Any) -> None:
    """ConfigError unless a config's stack of matrix-pose capsule layers is buildable: one positive
    `capsule_types` and `capsule_strides` entry per layer, a square `pose_dim`, and a last `grids` side >= 1."""
    types, strides = config.capsule_types, config.capsule_strides
    if len(types) != len(strides) or min((*types, *strides, 1)) < 1:
        raise ConfigError("capsule_types and capsule_strides need one positive value per capsule layer")
    if int(config.pose_dim**0.5) ** 2 != config.pose_dim:
        raise ConfigError(f"pose_dim must be a square (poses are matrices), got {config.pose_dim}")
    if config.grids[-1] < 1:
        raise ConfigError(f"image_size {config.image_size} is too small for the capsule layers")


# model name -> its config class: the one list of the built-in model names (`capsnet train --model`), read by the
# command line's parser without importing torch; capsnet.models.registry registers each model under its config's
# name.
MODEL_CONFIGS: dict[str, type] = {}


def register_config(name: str, config_class: type) -> None:
    """Record `config_class` as the config of model `name` (a name or a class registered twice is an error)."""
    if name in MODEL_CONFIGS or config_class in MODEL_CONFIGS.values():
        raise ValueError(f"model config {name!r} ({config_class.__name__}) is registered already")
    MODEL_CONFIGS[name] = config_class


def config_name(config_class: type | None) -> str | None:
    """The model name `config_class` is registered under (None: not a built-in model's config)."""
    return next((name for name, cls in MODEL_CONFIGS.items() if cls is config_class), None)
