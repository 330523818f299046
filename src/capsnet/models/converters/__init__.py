"""Converters of published weights into capsnet `save_pretrained` folders, one module per source format.

`CONVERTERS` maps a format name (what `capsnet convert FORMAT` takes) to a one-line description and the module
that reads it. Each module provides

    add_arguments(parser)            its own command-line options (argparse), e.g. --variant
    load(source, **options) -> model a capsnet model (a Pretrained nn.Module, in eval mode) computing what the source
                                     network computes, with the converted weights

and raises `capsnet.errors.CheckpointError` (one line) for a file it cannot read: not the format, a tensor
missing or of the wrong shape, named. PyTorch files are read with `torch.load(weights_only=True)`. The modules import
their readers (h5py, ...) lazily, so listing the formats needs none of them.

May import: capsnet.models, capsnet.nn, capsnet.routing and the foundation modules (as capsnet.models); never data,
training or above.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ...errors import CheckpointError, ConfigError
from ..pretrained import CONFIG_NAME, WEIGHTS_NAME


@dataclass(frozen=True)
class Converter:
    description: str  # one line, shown by `capsnet convert --help`
    module: str  # the module that reads the format, relative to this package

    def load(self, source: str | os.PathLike, **options: Any) -> Any:
        """The converted model (eval mode), not written anywhere: the module's `load`."""
        return importlib.import_module(self.module, __name__).load(source, **options)


CONVERTERS: dict[str, Converter] = {
    "efficient-capsnet": Converter(
        "the Efficient-CapsNet authors' Keras .h5 weights (EscVM/Efficient-CapsNet bin/efficient_capsnet_*.h5: "
        "MNIST, smallNORB, MultiMNIST), classifier and reconstruction network",
        ".efficient_capsnet_keras",
    ),
    "xifengguo-capsnet": Converter(
        "XifengGuo/CapsNet-Pytorch: its CapsuleNet state_dict (MNIST CapsNet, flat primary capsules)", ".xifengguo"
    ),
    "gram-ai-capsnet": Converter(
        "gram-ai/capsule-networks: its CapsuleNet state_dict (MNIST CapsNet, coupling softmax over the inputs)",
        ".gram_ai",
    ),
    "heinsen-capsnet": Converter(
        "glassroom/heinsen_routing (2019): its SmallNORBClassifier state_dict (smallNORB_pretrained_model_state_"
        "dict.pt), read with weights_only=True",
        ".heinsen",
    ),
    "inverted-attention": Converter(
        "apple/ml-capsules-inverted-attention-routing: its CapsModel checkpoint (simple or ResNet backbone), poses "
        "transposed",
        ".inverted_attention",
    ),
}


def converter_module(name: str) -> ModuleType:
    """The module that converts format `name`; ConfigError naming the known formats otherwise."""
    if name not in CONVERTERS:
        raise ConfigError(f"unknown weights format {name!r}; known: {', '.join(CONVERTERS)}")
    return importlib.import_module(CONVERTERS[name].module, __name__)


def convert(
    name: str, source: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False, **options: Any
) -> Any:
    """Convert `source` (format `name`) and write the model to the save_pretrained folder `out`; returns the model.

    A folder that already holds a model is kept unless `overwrite`; nothing is written when the source fails."""
    out = Path(out)
    if not overwrite and any((out / f).exists() for f in (CONFIG_NAME, WEIGHTS_NAME)):
        raise CheckpointError(f"{out}: already holds a model; choose another folder or pass --overwrite")
    model = converter_module(name).load(source, **options)
    model.save_pretrained(out)
    return model


__all__ = ["CONVERTERS", "Converter", "convert", "converter_module"]
