"""XifengGuo/CapsNet-Pytorch (`capsulenet.py`): its `model.state_dict()` (`torch.save`d as trained_model.pkl or
epochN.pkl) as a capsnet `capsnet.models.CapsNet`.

Their network is the paper's MNIST CapsNet with three layouts of their own, all kept by the conversion:

- primary capsules: the 256-channel output of the 9×9 stride-2 convolution is `view`ed as [B, 1152, 8], so each
  capsule is 8 consecutive values of the flattened [256, 6, 6] map (`primary_grouping="flat"`);
- routing: the votes are detached in all but the last iteration (`detach_votes=True`);
- DigitCaps weight [classes, 1152, 16, 8] with û = W u; capsnet's `Router` holds [1152, classes, 8, 16].

Their squash divides by |s| + 1e-8 where capsnet takes sqrt(|s|² + 1e-8) (a relative difference below 1e-6), and
their reconstruction loss, mean squared error × 0.0005·784, is capsnet's default 0.0005 × summed squared error.
"""

from __future__ import annotations

import argparse
import math
import os

from ...errors import CheckpointError
from ..capsnet import CapsNet, CapsNetConfig
from .common import Tensors, add_routing_iterations, decoder_state, load_into, load_state_dict

FORMAT = "XifengGuo/CapsNet-Pytorch"


def load(path: str | os.PathLike, *, routing_iterations: int = 3) -> CapsNet:
    """Their saved state dict -> a CapsNet computing what their `CapsuleNet` computes (in eval mode)."""
    t = Tensors(load_state_dict(path), path, FORMAT)
    conv_channels, in_channels, k, _ = t.take_any("conv1.weight", ndim=4).shape
    n_classes, n_primary, class_dim, primary_dim = t.take_any("digitcaps.weight", ndim=4).shape
    primary_out = t.take_any("primarycaps.conv2d.weight", ndim=4).shape[0]
    hidden = [t.take_any(f"decoder.{i}.weight", ndim=2).shape[0] for i in (0, 2)]
    pixels = t.take_any("decoder.4.weight", ndim=2).shape[0]
    side = math.isqrt(pixels // max(in_channels, 1))
    if primary_out % primary_dim or side * side * in_channels != pixels:
        raise_shape(t, "primarycaps.conv2d.weight" if primary_out % primary_dim else "decoder.4.weight")
    config = CapsNetConfig(
        in_channels=in_channels,
        image_size=side,
        n_classes=n_classes,
        conv_channels=conv_channels,
        kernel_size=k,
        primary_types=primary_out // primary_dim,
        primary_dim=primary_dim,
        class_dim=class_dim,
        routing_iterations=routing_iterations,
        detach_votes=True,
        decoder_hidden=tuple(hidden),
        primary_grouping="flat",
        digits=in_channels == 1,  # (their greyscale networks are their MNIST ones: digit-style images)
    )
    if config.n_primary != n_primary:
        raise_shape(t, "digitcaps.weight", f"{n_primary} input capsules where the convolutions give {config.n_primary}")
    state = {
        "conv1.weight": t.take("conv1.weight", (conv_channels, in_channels, k, k)),
        "conv1.bias": t.take("conv1.bias", (conv_channels,)),
        "primary.conv.weight": t.take("primarycaps.conv2d.weight", (primary_out, conv_channels, k, k)),
        "primary.conv.bias": t.take("primarycaps.conv2d.bias", (primary_out,)),
        # W [J, I, out_d, in_d] (û = W u) -> capsnet's [I, J, in_d, out_d]
        "class_caps.weight": t.take("digitcaps.weight", (n_classes, n_primary, class_dim, primary_dim))
        .permute(1, 0, 3, 2)
        .contiguous(),
    }
    state.update(decoder_state(t, [n_classes * class_dim, *hidden, pixels]))
    t.finish()
    model = CapsNet(config=config)
    load_into(model, state, path)
    return model


def raise_shape(t: Tensors, key: str, why: str = "") -> None:
    raise CheckpointError(
        f"{t.path}: tensor {key!r} has shape {list(t.shape(key))}, which no {FORMAT} "
        f"CapsuleNet builds{': ' + why if why else ''}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_routing_iterations(parser, 3)
