"""A model's own input pipeline per data format, for `--augment auto`.

A model class may name, in `data_recipes`, the TrainConfig values its authors' pipeline uses on a data format
(capsnet.data.sources.FORMATS): {"smallnorb": {"augment": "crop=48,...", "image_size": "64"}}. `augment` replaces
the format's default augmentation (capsnet.data.imageaug.DEFAULTS); `image_size` is the size the reader converts
the images to (unless `--image-size` is given). An explicit `--augment` uses neither.
"""

from __future__ import annotations

from typing import Any

from ..data.datasets import dataset_format
from ..models.registry import MODELS


def model_recipes(model: str | None) -> dict[str, dict[str, str]]:
    """The `data_recipes` of the model registered as `model` ({} for none or an unknown name)."""
    return dict(getattr(MODELS.get(model or ""), "data_recipes", {}))


def recipe_image_size(config: Any, recipes: dict[str, dict[str, str]]) -> str | None:
    """TrainConfig.image_size, or, when it is unset and the augmentation is "auto", the size the model's recipe for
    the data set's format names (the format is read from the files, nothing is loaded)."""
    given = getattr(config, "image_size", None)
    if given or getattr(config, "augment", "auto") != "auto" or not recipes:
        return given
    kind = dataset_format(config.dataset, data_dir=config.data_dir)
    return recipes.get(kind, {}).get("image_size")


__all__ = ["model_recipes", "recipe_image_size"]
