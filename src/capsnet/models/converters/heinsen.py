"""glassroom/heinsen_routing (2019, `models.py` `SmallNORBClassifier`): its published smallNORB state dict
(smallNORB_pretrained_model_state_dict.pt, a 2019 `torch.save` in the legacy format, which
`torch.load(weights_only=True)` reads) as a capsnet `capsnet.models.heinsen_capsnet.HeinsenCapsNet`.

capsnet's model keeps their module names, so the conversion renames the routings' `W`, `B` to `weight`, `bias` and
drops their constant buffer `CONST_one`; everything else (the BatchNorms' running statistics included) is taken as
it is, each tensor checked against the shape the sizes read from the file give.
"""

from __future__ import annotations

import argparse
import os

import torch

from ...errors import CheckpointError
from ..heinsen_capsnet import POSE, HeinsenCapsNet, HeinsenCapsNetConfig
from .common import Tensors, add_routing_iterations, load_into, load_state_dict

FORMAT = "glassroom/heinsen_routing SmallNORBClassifier"
N_CONVS = 6


def load(path: str | os.PathLike, *, routing_iterations: int = 3) -> HeinsenCapsNet:
    """Their saved state dict -> a HeinsenCapsNet computing what their `SmallNORBClassifier` computes (eval mode)."""
    t = Tensors(load_state_dict(path), path, FORMAT)
    channels, in_plus_grid = t.take_any("convolve.1.weight", ndim=4).shape[:2]
    n_parts = t.take_any("compute_a.1.weight", ndim=4).shape[0]
    n_classes = t.take_any("routings.1.W", ndim=4).shape[1]
    if in_plus_grid < 3:
        raise CheckpointError(
            f"{path}: tensor 'convolve.1.weight' has {in_plus_grid} input channels; their model "
            "has the image's and 2 of coordinates"
        )
    try:
        config = HeinsenCapsNetConfig(
            in_channels=in_plus_grid - 2,
            image_size=96,
            n_classes=n_classes,
            conv_channels=channels,
            n_parts=n_parts,
            routing_iterations=routing_iterations,
            class_names=("animal", "human", "airplane", "truck", "car") if n_classes == 5 else (),
            conv_padding=0,
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: sizes that make no {FORMAT}: {e}") from None
    state: dict[str, torch.Tensor] = {}
    for i in range(N_CONVS):  # [BatchNorm, Conv2d, Swish] × 6
        c_in = in_plus_grid if i == 0 else channels
        state |= {f"convolve.{3 * i}.{k}": v for k, v in t.take_batchnorm(f"convolve.{3 * i}", c_in).items()}
        state[f"convolve.{3 * i + 1}.weight"] = t.take(f"convolve.{3 * i + 1}.weight", (channels, c_in, 3, 3))
        state[f"convolve.{3 * i + 1}.bias"] = t.take(f"convolve.{3 * i + 1}.bias", (channels,))
    for name, out in (("compute_a", n_parts), ("compute_mu", n_parts * POSE * POSE)):
        state |= {f"{name}.0.{k}": v for k, v in t.take_batchnorm(f"{name}.0", channels).items()}
        state[f"{name}.1.weight"] = t.take(f"{name}.1.weight", (out, channels, 1, 1))
        state[f"{name}.1.bias"] = t.take(f"{name}.1.bias", (out,))
    for i, (n_in, n_out) in enumerate([(1, n_parts), (n_parts, n_classes)]):
        state[f"routings.{i}.weight"] = t.take(f"routings.{i}.W", (n_in, n_out, POSE, POSE))
        state[f"routings.{i}.bias"] = t.take(f"routings.{i}.B", (n_in, n_out, POSE, POSE))
        for beta in ("beta_use", "beta_ign"):
            state[f"routings.{i}.{beta}"] = t.take(f"routings.{i}.{beta}", (n_in, n_out))
        if t.has(f"routings.{i}.CONST_one"):
            t.take(f"routings.{i}.CONST_one", ())
    t.finish()
    model = HeinsenCapsNet(config=config)
    load_into(model, state, path)
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_routing_iterations(parser, 3)
