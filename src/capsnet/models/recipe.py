"""A model's input recipe: how raw images become the tensor its forward takes, in one place (docs/inputs.md).

Raw images are uint8 pixels p in 0..255, or float images x01 = p / 255 in [0, 1], [B, C, H, W]. The recipe a
model records in its config.json (capsnet.models.inputs.RecordedData) turns them into its input, in this order:

1. float: x01 = p / 255 (a float image passes as it is);
2. size: images of the size the model recorded before its training crops (`source_size`) are centre-cropped to
   its input size (the test-time counterpart of random crops); images of its input size pass;
3. values: x = (255 · x01 − mean_c) / std_c, per channel c: the model's `input_divisor` d is mean 0, std d (÷ 255
   the identity on x01); with `channel_standardize`, mean_c and std_c are the statistics of the split being read
   (`stats`, the Efficient-CapsNet authors' smallNORB input) or else the training split's recorded ones.

Per-image standardisation (`standardize`) runs inside the models' forward. `digits` says whether the raw images
are digit-style ink images (white on black, a 20/28 box): `capsnet predict` converts image files to that form.

Every path calls `model_input` (or a task's batches, which apply the same recipe's `InputRecipe.scale`
before their random crops): the training tasks, the graph-captured step, `fit`'s loader, evaluate, predict,
visualize, the ensemble (each member its own recipe) and the exported graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, DatasetError
from ..pixels import to_float

Stats = tuple[tuple[float, ...], tuple[float, ...]]  # per-channel (mean, std) of pixels p in 0..255


@dataclass(frozen=True)
class InputRecipe:
    """What a model takes and how raw images become it. `channels`, `size` (H, W) and `n_classes` are None for a
    module of one's own that records none (nothing is checked, and its input is x01)."""

    channels: int | None = None
    size: tuple[int, int] | None = None
    n_classes: int | None = None
    source_size: tuple[int, ...] = ()  # (H, W) before the training crops; () when the model trained uncropped
    divisor: float = 255.0
    channel_standardize: bool = False
    mean: tuple[float, ...] = ()  # the training split's per-channel statistics (with channel_standardize)
    std: tuple[float, ...] = ()
    digits: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> InputRecipe:
        """The recipe a model config records (RecordedData's fields; missing ones take the defaults)."""
        size = getattr(cfg, "image_size", None)
        if size is not None:
            size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        return cls(
            channels=getattr(cfg, "in_channels", None),
            size=size,
            n_classes=getattr(cfg, "n_classes", None),
            source_size=tuple(getattr(cfg, "source_size", ())),
            divisor=float(getattr(cfg, "input_divisor", 255.0)),
            channel_standardize=bool(getattr(cfg, "channel_standardize", False)),
            mean=tuple(getattr(cfg, "channel_mean", ())),
            std=tuple(getattr(cfg, "channel_std", ())),
            digits=bool(getattr(cfg, "digits", False)),
        )

    def fields(self) -> dict[str, Any]:
        """The config fields that record this recipe's values (what a training task writes into the model)."""
        return {
            "input_divisor": self.divisor,
            "channel_standardize": self.channel_standardize,
            "channel_mean": self.mean if self.channel_standardize else (),
            "channel_std": self.std if self.channel_standardize else (),
        }

    @property
    def raw_size(self) -> tuple[int, int] | None:
        """(H, W) of the raw images the model reads: its size before the training crops, else its input size."""
        return (int(self.source_size[0]), int(self.source_size[1])) if self.source_size else self.size

    def statistics(self, stats: Stats | None = None) -> Stats:
        """The (mean, std) of step 3: `stats` (a split's own) or the recorded ones with channel_standardize,
        else (0, divisor)."""
        if not self.channel_standardize:
            return (0.0,), (self.divisor,)
        if stats is not None:
            return stats
        if not self.std:
            raise DatasetError(
                "the model standardizes each channel with its training split's statistics, which its "
                "config.json does not record; evaluate it on a data set split instead"
            )
        return self.mean, self.std

    def scale(self, x01: torch.Tensor, stats: Stats | None = None) -> torch.Tensor:
        """Step 3 on float images x01 [B, C, H, W]: x = (255 · x01 − mean_c) / std_c (one value: every channel)."""
        mean, std = self.statistics(stats)
        if all(m == 0 for m in mean) and all(s == 255 for s in std):
            return x01
        c = x01.shape[1]
        for name, values in (("mean", mean), ("std", std)):
            if len(values) not in (1, c):
                raise DatasetError(f"input recipe: {len(values)} {name} values for images with {c} channels")
        m = torch.tensor(mean, dtype=x01.dtype, device=x01.device).view(1, -1, 1, 1) / 255.0
        s = 255.0 / torch.tensor(std, dtype=x01.dtype, device=x01.device).view(1, -1, 1, 1)
        return (x01 - m) * s  # (p/255 − mean/255) · 255/std = (p − mean) / std

    def fit_size(self, x: torch.Tensor) -> torch.Tensor:
        """Step 2: images [B, C, H, W] of `source_size` centre-cropped to the input size; others pass."""
        if self.size is None or tuple(x.shape[-2:]) == self.size or tuple(x.shape[-2:]) != self.raw_size:
            return x
        (h, w), (big_h, big_w) = self.size, x.shape[-2:]
        top, left = (big_h - h) // 2, (big_w - w) // 2
        return x[..., top : top + h, left : left + w]

    def prepare(self, images: torch.Tensor, stats: Stats | None = None) -> torch.Tensor:
        """Raw images (uint8, or floats in [0, 1]) [B, C, H, W] -> the model's input (steps 1-3)."""
        return self.scale(self.fit_size(to_float(images)), stats)

    def describe(self) -> str:
        """The value conversion in words, for messages and the export's metadata."""
        if self.channel_standardize:
            return "(p - mean_c) / std_c per channel (the split's statistics; single images: the training split's)"
        return f"p / {self.divisor:g}"


def recipe_of(model: Any) -> InputRecipe:
    """The recipe of `model`: its `input_recipe` when it has one, else the one its config records."""
    own = getattr(model, "input_recipe", None)
    if isinstance(own, InputRecipe):
        return own
    return InputRecipe.from_config(getattr(model, "config", None))


def model_input(model: Any, images: torch.Tensor, *, stats: Stats | None = None) -> torch.Tensor:
    """Raw images -> what `model`'s forward takes. A model with a `prepare_input(images, stats)` method (the
    ensemble: one input per member) prepares its own; any other by its recipe (`recipe_of`)."""
    prepare = getattr(model, "prepare_input", None)
    if callable(prepare):
        return prepare(images, stats)
    return recipe_of(model).prepare(images, stats)


def recipe_for(
    *, divisor: float = 255.0, channel_standardize: bool = False, stats: Stats | None = None, **shape: Any
) -> InputRecipe:
    """A training task's recipe: ÷ `divisor`, or per-channel standardisation with the training split's `stats`."""
    if channel_standardize and stats is None:
        raise ConfigError("per-channel standardization needs the training split's statistics")
    mean, std = stats if channel_standardize and stats is not None else ((), ())
    return InputRecipe(
        divisor=float(divisor), channel_standardize=channel_standardize, mean=tuple(mean), std=tuple(std), **shape
    )


__all__ = ["InputRecipe", "Stats", "model_input", "recipe_for", "recipe_of"]
