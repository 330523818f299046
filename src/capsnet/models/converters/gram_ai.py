"""gram-ai/capsule-networks (`capsule_network.py`): its `model.state_dict()` (`torch.save`d as epochs/epoch_N.pt) as
a capsnet `capsnet.models.CapsNet`.

Their network is the paper's MNIST CapsNet, laid out differently:

- primary capsules: 8 separate 9×9 stride-2 convolutions of 32 channels (`primary_capsules.capsules.{d}`), one per
  capsule dimension d; capsule (type t, row, column) takes channel t of each. capsnet's one convolution holds
  channel t·8 + d;
- DigitCaps weight `route_weights` [classes, 1152, 8, 16] (û = u W); capsnet's `Router` holds [1152, classes, 8, 16];
- routing: their softmax of Eq. 3 runs over the 1152 input capsules (dim 2 of their [classes, B, 1152, 1, 16]
  logits), not over the classes, which capsnet reproduces with `coupling="inputs"`.

Their class scores are softmax(|v_j|), on which their margin loss acts; the converted model's `lengths` are |v_j|
(its margin loss, if trained further, acts on them), with the same argmax. Their squash has no ε (NaN at s = 0).
"""

from __future__ import annotations

import argparse
import math
import os
import re

import torch

from ...errors import CheckpointError
from ..capsnet import CapsNet, CapsNetConfig
from .common import Tensors, add_routing_iterations, decoder_state, load_into, load_state_dict

FORMAT = "gram-ai/capsule-networks"


def load(path: str | os.PathLike, *, routing_iterations: int = 3) -> CapsNet:
    """Their saved state dict -> a CapsNet computing what their `CapsuleNet` computes (in eval mode)."""
    t = Tensors(load_state_dict(path), path, FORMAT)
    conv_channels, in_channels, k, _ = t.take_any("conv1.weight", ndim=4).shape
    dims = sorted(
        int(m.group(1)) for key in t.state if (m := re.fullmatch(r"primary_capsules\.capsules\.(\d+)\.weight", key))
    )
    if not dims or dims != list(range(len(dims))):
        raise CheckpointError(
            f"{path}: missing tensor 'primary_capsules.capsules.0.weight' (not a {FORMAT} state dict?)"
        )
    n_types, _, k2, _ = t.take_any("primary_capsules.capsules.0.weight", ndim=4).shape
    n_classes, n_primary, primary_dim, class_dim = t.take_any("digit_capsules.route_weights", ndim=4).shape
    hidden = [t.take_any(f"decoder.{i}.weight", ndim=2).shape[0] for i in (0, 2)]
    pixels = t.take_any("decoder.4.weight", ndim=2).shape[0]
    side = math.isqrt(pixels // in_channels)
    if primary_dim != len(dims) or k2 != k or side * side * in_channels != pixels:
        key = "decoder.4.weight" if side * side * in_channels != pixels else "digit_capsules.route_weights"
        raise CheckpointError(
            f"{path}: tensor {key!r} has shape {list(t.shape(key))}, which does not fit the other "
            f"tensors of a {FORMAT} CapsuleNet"
        )
    config = CapsNetConfig(
        in_channels=in_channels,
        image_size=side,
        n_classes=n_classes,
        conv_channels=conv_channels,
        kernel_size=k,
        primary_types=n_types,
        primary_dim=primary_dim,
        class_dim=class_dim,
        routing_iterations=routing_iterations,
        decoder_hidden=tuple(hidden),
        coupling="inputs",
        digits=in_channels == 1,  # (their greyscale networks are their MNIST ones: digit-style images)
    )
    if config.n_primary != n_primary:
        raise CheckpointError(
            f"{path}: tensor 'digit_capsules.route_weights' has {n_primary} input capsules where "
            f"the convolutions give {config.n_primary}"
        )
    # conv d's channel t -> capsnet's channel t·D + d: stack on a new last axis of the types, then flatten
    weights = [t.take(f"primary_capsules.capsules.{d}.weight", (n_types, conv_channels, k, k)) for d in dims]
    biases = [t.take(f"primary_capsules.capsules.{d}.bias", (n_types,)) for d in dims]
    state = {
        "conv1.weight": t.take("conv1.weight", (conv_channels, in_channels, k, k)),
        "conv1.bias": t.take("conv1.bias", (conv_channels,)),
        "primary.conv.weight": torch.stack(weights, dim=1).reshape(n_types * primary_dim, conv_channels, k, k),
        "primary.conv.bias": torch.stack(biases, dim=1).reshape(-1),
        # [J, I, in_d, out_d] -> capsnet's [I, J, in_d, out_d]
        "class_caps.weight": t.take("digit_capsules.route_weights", (n_classes, n_primary, primary_dim, class_dim))
        .transpose(0, 1)
        .contiguous(),
        **decoder_state(t, [n_classes * class_dim, *hidden, pixels]),
    }
    t.finish()
    model = CapsNet(config=config)
    load_into(model, state, path)
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_routing_iterations(parser, 3)
