"""The Efficient-CapsNet authors' Keras weights (EscVM/Efficient-CapsNet, bin/efficient_capsnet_{MNIST,SMALLNORB,
MULTIMNIST}.h5, Apache-2.0) as a capsnet `capsnet.models.efficient_capsnet.EfficientCapsNet`.

The files are HDF5 as Keras's `Model.save_weights` writes them: the root attribute `layer_names` lists one group
per top-level layer of their training model; the classifier's group (named `CapsNet` or `Efficient_CapsNet`) and
the reconstruction network's (`Generator`) list their tensors in the attribute `weight_names`, each a dataset
`/<group>/<layer>/<weight>:0` (a whole-model file keeps them under `model_weights/`). Layers are recognised by
their tensors, not their names: a layer with `kernel` is a convolution (4-D) or a dense layer (2-D), one with
`gamma` and `beta` a normalisation (BatchNormalization when it has `moving_mean` and `moving_variance`), one with
`W` the capsule layer. The classifier is [conv, norm] × 4, the depthwise conv, the capsule layer.

Layouts: Keras convolution kernels [kh, kw, in, out] → PyTorch [out, in, kh, kw] (the depthwise one, 128 groups,
[k, k, 1, 128] → [128, 1, k, k]); dense kernels [in, out] → [out, in]; the capsule W [class k, primary j, i, z] →
capsnet's [j, k, i, z]; its b [k, j, 1] → the prior [j, k]. The variant (mnist, smallnorb, multimnist) is read from
the shapes: 2 input channels and 5 classes is smallNORB; 1 channel and 10 classes MNIST with a 9×9 depthwise
kernel, MultiMNIST with a 5×5 one.

The converted model computes what the Keras graph computes from the same float input (NCHW here, NHWC there);
config.json records the pre-processing their data pipeline applied, so that `capsnet evaluate` and `predict` feed
it the same: MNIST ÷ 256, MultiMNIST ÷ 255, smallNORB standardised per channel with the split's own statistics,
resized to 64×64 and centre-cropped to 48×48.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import CapsNetError, CheckpointError
from ...limits import array_too_large
from ..efficient_capsnet import EfficientCapsNet, EfficientCapsNetConfig

VARIANTS = ("mnist", "smallnorb", "multimnist")
SMALLNORB_CLASSES = ("animal", "human", "airplane", "truck", "car")  # smallNORB's category codes 0-4

Layer = tuple[str, dict[str, np.ndarray]]  # (layer name as in the file, its tensors by weight name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variant",
        choices=VARIANTS,
        default=None,
        help="which of the authors' models the file holds (default: read from its tensor shapes)",
    )


def preset(variant: str, *, decoder: bool = True) -> EfficientCapsNetConfig:
    """The config of the authors' `variant` model, with the pre-processing of their data pipeline recorded."""
    if variant == "smallnorb":
        return EfficientCapsNetConfig.for_smallnorb(
            decoder=decoder,
            channel_standardize=True,
            source_size=(64, 64),
            class_names=SMALLNORB_CLASSES,
            digits=False,
        )
    if variant == "multimnist":
        return EfficientCapsNetConfig.for_multimnist(decoder=decoder, digits=True)
    if variant == "mnist":
        return EfficientCapsNetConfig(decoder=decoder, input_divisor=256.0, digits=True)
    raise CheckpointError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def load(source: str | os.PathLike, *, variant: str | None = None) -> EfficientCapsNet:
    """The authors' Keras file `source` as an EfficientCapsNet (eval mode), its variant read from the shapes
    unless given. CheckpointError (one line) for a file that is not HDF5, lacks a tensor or has a wrong shape."""
    path = Path(source)
    classifier, generator = read_groups(path)
    variant = variant or detect_variant(path, classifier)
    with torch.random.fork_rng(devices=[]):  # the initial values are all replaced: leave the caller's RNG alone
        model = EfficientCapsNet(config=preset(variant, decoder=generator is not None))
    state = classifier_state(path, classifier, model, variant)
    if generator is not None:
        state.update(generator_state(path, generator, model, variant))
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:  # every tensor above is checked; this guards the mapping itself
        raise CheckpointError(f"{path}: no tensor for {', '.join(missing)}")
    model.load_state_dict(state, strict=True)
    return model.eval()


# ------------------------------------------------------------------------------------------------- reading
def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise CapsNetError("reading Keras .h5 weights needs h5py: pip install 'capsnet[convert]'") from None
    return h5py


def read_groups(path: Path) -> tuple[tuple[str, list[Layer]], tuple[str, list[Layer]] | None]:
    """((classifier group, its layers), (generator group, its layers) or None), layers in the file's order."""
    h5py = _h5py()
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    if not h5py.is_hdf5(str(path)):
        raise CheckpointError(f"{path}: not an HDF5 file (the authors' weights are Keras .h5 files)")
    try:
        with h5py.File(str(path), "r") as f:
            root = f["model_weights"] if "model_weights" in f and "layer_names" not in f.attrs else f
            if "layer_names" not in root.attrs:
                raise CheckpointError(f"{path}: HDF5, but not Keras weights (no 'layer_names' attribute)")
            groups = [(_text(name), _layers(path, root[_text(name)])) for name in root.attrs["layer_names"]]
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot read the Keras weights ({e})") from None
    groups = [(name, layers) for name, layers in groups if layers]
    caps = [g for g in groups if any("W" in tensors for _, tensors in g[1])]
    if len(caps) != 1:
        raise CheckpointError(f"{path}: no capsule layer (a '<layer>/W:0' tensor): not Efficient-CapsNet weights")
    others = [g for g in groups if g is not caps[0]]
    if len(others) > 1:
        names = ", ".join(name for name, _ in others)
        raise CheckpointError(f"{path}: more than one group besides the classifier ({names}); expected a Generator")
    return caps[0], (others[0] if others else None)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _layers(path: Path, group: Any) -> list[Layer]:
    """A group's tensors by layer, in the order of its `weight_names` (trainable ones first, as Keras saves)."""
    layers: dict[str, dict[str, np.ndarray]] = {}
    for full in (_text(n) for n in group.attrs.get("weight_names", [])):
        layer, _, weight = full.rpartition("/")
        if full not in group:
            raise CheckpointError(f"{path}: {group.name.strip('/')}/{full} is listed but not stored")
        data = group[full]
        why = array_too_large(int(getattr(data, "size", 0) or 0), 4, path.stat().st_size)
        if why:  # (checked on the declared shape, before reading: a tiny file may declare terabytes)
            raise CheckpointError(f"{path}: {group.name.strip('/')}/{full}: {why}")
        layers.setdefault(layer, {})[weight.removesuffix(":0")] = np.asarray(group[full], dtype=np.float32)
    return list(layers.items())


# ---------------------------------------------------------------------------------------------- the variant
def detect_variant(path: Path, classifier: tuple[str, list[Layer]]) -> str:
    """mnist, smallnorb or multimnist from the first kernel's input channels, the classes and the depthwise
    kernel; CheckpointError naming the shapes when they fit none."""
    group, layers = classifier
    kernels = [(name, t["kernel"]) for name, t in layers if "kernel" in t]
    caps = [(name, t["W"]) for name, t in layers if "W" in t]
    if len(kernels) < 2 or not caps or kernels[0][1].ndim != 4 or caps[0][1].ndim != 4:
        raise CheckpointError(f"{path}: {group}: expected convolution kernels and a 4-D capsule W")
    channels, classes, depthwise = kernels[0][1].shape[2], caps[0][1].shape[0], kernels[-1][1].shape[0]
    found = {(2, 5): "smallnorb", (1, 10, 9): "mnist", (1, 10, 5): "multimnist"}
    variant = found.get((channels, classes)) or found.get((channels, classes, depthwise))
    if variant is None:
        raise CheckpointError(
            f"{path}: cannot tell the variant from the shapes ({group}/{kernels[0][0]}/kernel:0 "
            f"{list(kernels[0][1].shape)}, {caps[0][0]}/W:0 {list(caps[0][1].shape)}); pass --variant"
        )
    return variant


# ------------------------------------------------------------------------------------------- the mapping
def _take(path: Path, where: str, tensors: dict[str, np.ndarray], weight: str, want: tuple[int, ...]) -> np.ndarray:
    """Tensor `weight` of layer `where`, checked against the Keras shape `want`."""
    if weight not in tensors:
        raise CheckpointError(f"{path}: missing tensor {where}/{weight}:0 (shape {list(want)})")
    value = tensors[weight]
    if tuple(value.shape) != tuple(want):
        raise CheckpointError(f"{path}: {where}/{weight}:0 has shape {list(value.shape)}, expected {list(want)}")
    return value


def _conv(path, where, tensors, conv: torch.nn.Conv2d, prefix: str) -> dict[str, torch.Tensor]:
    out, per_group, kh, kw = conv.weight.shape
    kernel = _take(path, where, tensors, "kernel", (kh, kw, per_group, out))  # Keras HWIO
    bias = _take(path, where, tensors, "bias", (out,))
    return {
        f"{prefix}.weight": torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy()),
        f"{prefix}.bias": torch.from_numpy(bias.copy()),
    }


def _dense(path, where, tensors, linear: torch.nn.Linear, prefix: str) -> dict[str, torch.Tensor]:
    out, inp = linear.weight.shape
    kernel = _take(path, where, tensors, "kernel", (inp, out))
    bias = _take(path, where, tensors, "bias", (out,))
    return {f"{prefix}.weight": torch.from_numpy(kernel.T.copy()), f"{prefix}.bias": torch.from_numpy(bias.copy())}


def _norm(path, where, tensors, norm: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    c = int(norm.num_features)  # type: ignore[arg-type]
    state = {
        f"{prefix}.weight": torch.from_numpy(_take(path, where, tensors, "gamma", (c,)).copy()),
        f"{prefix}.bias": torch.from_numpy(_take(path, where, tensors, "beta", (c,)).copy()),
    }
    if isinstance(norm, torch.nn.BatchNorm2d):
        for keras, ours in (("moving_mean", "running_mean"), ("moving_variance", "running_var")):
            state[f"{prefix}.{ours}"] = torch.from_numpy(_take(path, where, tensors, keras, (c,)).copy())
        state[f"{prefix}.num_batches_tracked"] = torch.tensor(0)
    return state


def _sequence(path: Path, group: str, layers: list[Layer], kinds: list[str]) -> list[Layer]:
    """The group's layers, checked to be of `kinds` in order ("conv", "dense", "norm", "caps")."""

    def kind(t: dict[str, np.ndarray], want: str) -> str:
        if "W" in t:
            return "caps"
        if "gamma" in t or "beta" in t:
            return "norm"
        if "kernel" not in t:  # a layer with only its bias: _take names the missing kernel
            return want if want in ("conv", "dense") else "bias"
        return "conv" if t["kernel"].ndim == 4 else "dense"

    found = [kind(t, want) for (_, t), want in zip(layers, [*kinds, *[""] * len(layers)])]
    if found != kinds:
        raise CheckpointError(f"{path}: {group} holds layers {' '.join(found)}, the model needs {' '.join(kinds)}")
    return layers


def classifier_state(path: Path, classifier, model: EfficientCapsNet, variant: str) -> dict[str, torch.Tensor]:
    group, layers = classifier
    blocks = len(model.config.backbone_channels)
    layers = _sequence(path, group, layers, ["conv", "norm"] * blocks + ["conv", "caps"])
    modules: list[Any] = list(model.backbone)
    convs = [k for k, m in enumerate(modules) if isinstance(m, torch.nn.Conv2d)]
    norms = [k for k, m in enumerate(modules) if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.InstanceNorm2d))]
    state: dict[str, torch.Tensor] = {}
    for k in range(blocks):
        (conv_name, conv_t), (norm_name, norm_t) = layers[2 * k], layers[2 * k + 1]
        state.update(_conv(path, f"{group}/{conv_name}", conv_t, modules[convs[k]], f"backbone.{convs[k]}"))
        state.update(_norm(path, f"{group}/{norm_name}", norm_t, modules[norms[k]], f"backbone.{norms[k]}"))
    (dw_name, dw_t), (caps_name, caps_t) = layers[-2], layers[-1]
    state.update(_conv(path, f"{group}/{dw_name}", dw_t, model.primary, "primary"))
    router = model.class_caps
    w = _take(path, f"{group}/{caps_name}", caps_t, "W", (router.out_caps, router.in_caps, router.in_d, router.out_d))
    b = _take(path, f"{group}/{caps_name}", caps_t, "b", (router.out_caps, router.in_caps, 1))
    state["class_caps.weight"] = torch.from_numpy(w.transpose(1, 0, 2, 3).copy())  # [k, j, i, z] -> [j, k, i, z]
    state["class_caps.prior"] = torch.from_numpy(b[:, :, 0].T.copy())  # [k, j, 1] -> [j, k]
    return state


def generator_state(path: Path, generator, model: EfficientCapsNet, variant: str) -> dict[str, torch.Tensor]:
    group, layers = generator
    decoder: Any = model.decoder
    state: dict[str, torch.Tensor] = {}
    if model.config.decoder_type == "conv":  # Dense, then four 3×3 convolutions
        layers = _sequence(path, group, layers, ["dense", "conv", "conv", "conv", "conv"])
        state.update(_dense(path, f"{group}/{layers[0][0]}", layers[0][1], decoder.fc, "decoder.fc"))
        convs = [*decoder.convs, decoder.out]
        prefixes = [f"decoder.convs.{k}" for k in range(len(decoder.convs))] + ["decoder.out"]
        for (name, tensors), conv, prefix in zip(layers[1:], convs, prefixes, strict=True):
            state.update(_conv(path, f"{group}/{name}", tensors, conv, prefix))
        return state
    linears = [k for k, m in enumerate(decoder.net) if isinstance(m, torch.nn.Linear)]
    layers = _sequence(path, group, layers, ["dense"] * len(linears))
    for (name, tensors), k in zip(layers, linears, strict=True):
        state.update(_dense(path, f"{group}/{name}", tensors, decoder.net[k], f"decoder.net.{k}"))
    return state


__all__ = ["VARIANTS", "add_arguments", "detect_variant", "load", "preset", "read_groups"]
