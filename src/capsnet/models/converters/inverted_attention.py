"""apple/ml-capsules-inverted-attention-routing (`main_capsule.py`): its checkpoint (`ckpt.pth`, a dict whose "net" is
the `CapsModel` state dict, keys prefixed `module.` under DataParallel) as a capsnet
`capsnet.models.InvertedAttentionCapsNet`.

What the conversion rearranges or sets (docs/fidelity.md):

- poses: their votes are V = P·W, capsnet's V = W·P. The converted model holds every pose as the transpose of
  theirs: the primary convolution's channels, every LayerNorm's γ and β and the classifier's weights are permuted
  accordingly, and each W becomes its transpose. Agreements (Frobenius products) and LayerNorm are unchanged by it.
- their conv capsule weight [k, k, in_types, 4, 4, out_types] -> [in_types·k·k, out_types, 4, 4]; their FC capsule
  weight [in_caps, 4, 4, out_caps] -> [in_caps, out_caps, 4, 4];
- the agreement scale 1/√d, their per-channel CIFAR normalisation (`input_mean`, `input_std`), concurrent routing,
  and their convolutional capsules' window expansion (`conv_windows="released"`), which the weights were trained
  with; their simple or ResNet backbone, found from the tensors.

The structure their JSON config gives and the weights do not (image size, conv capsule strides, routing
iterations) comes from the options (`add_arguments`); the defaults are their CIFAR-10 configuration with
`--num_routing 2`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re

import torch

from ...errors import CheckpointError
from ..inverted_attention_capsnet import (
    RESNET_BLOCKS,
    RESNET_STEM,
    InvertedAttentionCapsNet,
    InvertedAttentionCapsNetConfig,
)
from .common import Tensors, add_routing_iterations, load_into, load_state_dict

FORMAT = "apple/ml-capsules-inverted-attention-routing"
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)  # their main_capsule.py Normalize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """What their JSON config and command line gave and the weights do not record; defaults: their CIFAR-10 run."""
    parser.add_argument("--image-size", type=int, default=32, help="input side (default: 32)")
    parser.add_argument(
        "--capsule-strides",
        type=int,
        nargs="+",
        default=[2, 1],
        metavar="S",
        help="strides of the convolutional capsule layers (default: 2 1)",
    )
    add_routing_iterations(parser, 2)
    parser.add_argument(
        "--concurrent",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="route the layers concurrently, as their code does (default: on)",
    )
    parser.add_argument(
        "--conv-windows",
        choices=["released", "true"],
        default="released",
        help="their released window expansion, which the weights were trained with, or the true "
        "k×k windows (default: released)",
    )
    parser.add_argument(
        "--input-mean",
        type=float,
        nargs="+",
        default=list(CIFAR10_MEAN),
        metavar="M",
        help="per-channel input mean (default: their CIFAR-10 normalisation)",
    )
    parser.add_argument(
        "--input-std",
        type=float,
        nargs="+",
        default=list(CIFAR10_STD),
        metavar="S",
        help="per-channel input std (default: their CIFAR-10 normalisation)",
    )


def load(
    path: str | os.PathLike,
    *,
    image_size: int = 32,
    capsule_strides: tuple[int, ...] = (2, 1),
    routing_iterations: int = 2,
    concurrent: bool = True,
    conv_windows: str = "released",
    input_mean: tuple[float, ...] = CIFAR10_MEAN,
    input_std: tuple[float, ...] = CIFAR10_STD,
) -> InvertedAttentionCapsNet:
    """Their saved checkpoint -> an InvertedAttentionCapsNet computing what their `CapsModel` computes (eval mode)."""
    t = Tensors(load_state_dict(path), path, FORMAT)
    layers = sorted(int(m.group(1)) for k in t.state if (m := re.fullmatch(r"capsule_layers\.(\d+)\.w", k)))
    if not layers or layers != list(range(len(layers))):
        raise CheckpointError(f"{path}: missing tensor 'capsule_layers.0.w' (not a {FORMAT} state dict?)")
    pose_dim = t.take_any("nonlinear_act.weight", ndim=1).shape[0]
    side = round(pose_dim**0.5)
    if side * side != pose_dim:
        raise CheckpointError(f"{path}: {pose_dim}-D poses: only matrix poses (a square pose_dim) convert")
    *conv_layers, fc = layers
    hidden_fc = [i for i in conv_layers if len(t.shape(f"capsule_layers.{i}.w")) == 4]
    if hidden_fc:
        layer = f"capsule_layers.{hidden_fc[0]}"
        raise CheckpointError(
            f"{path}: '{layer}' is a fully connected capsule layer before the class capsules "
            "(their CIFAR-100 configuration), which capsnet's model lacks"
        )
    for i in conv_layers:
        shape = t.take_any(f"capsule_layers.{i}.w", ndim=6).shape
        if shape[0] != 3 or shape[1] != 3 or shape[3:5] != (side, side):
            raise CheckpointError(
                f"{path}: tensor 'capsule_layers.{i}.w' has shape {list(shape)}; capsnet's conv "
                f"capsules are 3x3 with {side}x{side} matrix poses"
            )
    fc_shape = t.take_any(f"capsule_layers.{fc}.w", ndim=4).shape  # [in_caps, √d, √d, classes]
    if fc_shape[1:3] != (side, side):
        raise CheckpointError(
            f"{path}: tensor 'capsule_layers.{fc}.w' has shape {list(fc_shape)}; capsnet converts "
            "conv capsule layers followed by one fully connected class layer"
        )
    if len(capsule_strides) != len(conv_layers):
        raise CheckpointError(
            f"{path}: {len(conv_layers)} conv capsule layers; give their strides "
            f"(capsule_strides has {len(capsule_strides)})"
        )
    resnet = t.has("pre_caps.pre_caps.1.running_mean")
    pc_out, stem, pk, _ = t.take_any("pc_layer.weight", ndim=4).shape
    in_channels = t.take_any("pre_caps.pre_caps.0.weight", ndim=4).shape[1]
    types = [pc_out // pose_dim] + [t.shape(f"capsule_layers.{i}.w")[5] for i in conv_layers]
    config = InvertedAttentionCapsNetConfig(
        in_channels=in_channels,
        image_size=image_size,
        n_classes=fc_shape[3],
        stem_channels=stem,
        primary_types=types[0],
        pose_dim=pose_dim,
        capsule_types=tuple(types[1:]),
        capsule_strides=capsule_strides,
        routing_iterations=routing_iterations,
        concurrent=concurrent,
        backbone="resnet" if resnet else "simple",
        input_mean=tuple(input_mean),
        input_std=tuple(input_std),
        conv_windows=conv_windows,  # type: ignore[arg-type]
    )
    if pk != 1 or pc_out % pose_dim or fc_shape[0] != types[-1] * config.grids[-1] ** 2:
        raise CheckpointError(
            f"{path}: tensor 'capsule_layers.{fc}.w' has {fc_shape[0]} input capsules where "
            f"{image_size}x{image_size} images with capsule strides {list(capsule_strides)} give "
            f"{types[-1] * config.grids[-1] ** 2} (set image_size / capsule_strides)"
        )
    perm = torch.arange(pose_dim).view(side, side).t().reshape(-1)  # capsnet's pose = the transpose of theirs
    channels = (torch.arange(types[0]).view(-1, 1) * pose_dim + perm).reshape(-1)
    state = backbone_state(t, in_channels, stem, resnet)
    state["primary.weight"] = t.take("pc_layer.weight", (pc_out, stem, 1, 1))[channels]
    state.update(layer_norm(t, "nonlinear_act", "primary_norm", perm))
    for i, (n_in, n_out) in enumerate(itertools.pairwise(types)):  # [k, k, n, x, d, m] -> [n·k·k, m, d, x]
        w = t.take(f"capsule_layers.{i}.w", (3, 3, n_in, side, side, n_out))
        state[f"capsules.{i}.weight"] = w.permute(2, 0, 1, 5, 4, 3).reshape(n_in * 9, n_out, side, side)
        state.update(layer_norm(t, f"capsule_layers.{i}.nonlinear_act", f"capsules.{i}.norm", perm))
    w = t.take(f"capsule_layers.{fc}.w", tuple(fc_shape))  # [n, x, d, m] -> [n, m, d, x]
    state[f"capsules.{fc}.weight"] = w.permute(0, 3, 2, 1).contiguous()
    state.update(layer_norm(t, f"capsule_layers.{fc}.nonlinear_act", f"capsules.{fc}.norm", perm))
    state["classifier.weight"] = t.take("final_fc.weight", (1, pose_dim))[:, perm]
    state["classifier.bias"] = t.take("final_fc.bias", (1,))
    t.finish()
    model = InvertedAttentionCapsNet(config=config)
    load_into(model, state, path)
    return model


def layer_norm(t: Tensors, theirs: str, ours: str, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    d = perm.numel()
    return {f"{ours}.{name}": t.take(f"{theirs}.{name}", (d,))[perm] for name in ("weight", "bias")}


def backbone_state(t: Tensors, in_channels: int, width: int, resnet: bool) -> dict[str, torch.Tensor]:
    """Their `pre_caps.pre_caps` Sequential -> capsnet's `backbone`: one biased convolution, or the ResNet whose
    stem (0, 1), layer1 (3.k) and layer2 (4.k) become capsnet's flat backbone.0, .1, .3 … .9."""
    if not resnet:
        return {
            "backbone.weight": t.take("pre_caps.pre_caps.0.weight", (width, in_channels, 3, 3)),
            "backbone.bias": t.take("pre_caps.pre_caps.0.bias", (width,)),
        }
    out = {"backbone.0.weight": t.take("pre_caps.pre_caps.0.weight", (RESNET_STEM, in_channels, 3, 3))}
    out.update({f"backbone.1.{k}": v for k, v in t.take_batchnorm("pre_caps.pre_caps.1", RESNET_STEM).items()})
    index, c_in = 3, RESNET_STEM
    for stage, (c_out, n_blocks) in enumerate(zip((RESNET_STEM, width), RESNET_BLOCKS, strict=True)):
        for k in range(n_blocks):
            theirs, ours = f"pre_caps.pre_caps.{3 + stage}.{k}", f"backbone.{index}"
            out[f"{ours}.conv1.weight"] = t.take(f"{theirs}.conv1.weight", (c_out, c_in, 3, 3))
            out[f"{ours}.conv2.weight"] = t.take(f"{theirs}.conv2.weight", (c_out, c_out, 3, 3))
            for bn in ("bn1", "bn2"):
                out.update({f"{ours}.{bn}.{n}": v for n, v in t.take_batchnorm(f"{theirs}.{bn}", c_out).items()})
            if stage > 0 and k == 0:  # the stride-2 block's 1×1 projection shortcut
                out[f"{ours}.shortcut.0.weight"] = t.take(f"{theirs}.shortcut.0.weight", (c_out, c_in, 1, 1))
                norm = t.take_batchnorm(f"{theirs}.shortcut.1", c_out)
                out.update({f"{ours}.shortcut.1.{n}": v for n, v in norm.items()})
            index, c_in = index + 1, c_out
    return out
