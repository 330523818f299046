"""Converters from other implementations' published weights to capsnet models, one module per format.

`CONVERTERS` maps a format name to a :class:`Converter`: a one-line `description` and `convert(path, **options)`,
which returns the capsnet model (in eval mode) computing what the source network computes; `save_pretrained` it to
get a capsnet folder. PyTorch files are read with `torch.load(weights_only=True)`; a bad file is one
:class:`capsnet.errors.CheckpointError` naming the tensor.

May import: capsnet.models (and what it may import); never data, training or above.
"""

from __future__ import annotations

from . import gram_ai, inverted_attention, xifengguo
from .common import Converter

CONVERTERS: dict[str, Converter] = {}
CONVERTERS["xifengguo-capsnet"] = xifengguo.CONVERTER
CONVERTERS["gram-ai-capsnet"] = gram_ai.CONVERTER
CONVERTERS["inverted-attention"] = inverted_attention.CONVERTER

__all__ = ["CONVERTERS", "Converter"]
