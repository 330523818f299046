"""Keras's weight initialisers (TensorFlow 2.x `tf.keras.initializers`), for models whose authors trained in Keras.

Keras computes a kernel's fans from its own layout, [..., fan_in axis, fan_out axis]: for a tensor of rank ≥ 3,
receptive = product of all but the last two dimensions, fan_in = shape[-2] · receptive, fan_out = shape[-1] ·
receptive (a Conv2D kernel [kh, kw, in, out]: fan_in = kh·kw·in). The functions here take that Keras shape, so
that a PyTorch tensor of another layout gets the fans its Keras counterpart had.

  he_normal        truncated normal, std √(2 / fan_in) / 0.8796, cut at ±2 std (the 0.8796 restores the std lost
                   by the truncation), VarianceScaling(2, "fan_in", "truncated_normal")
  glorot_normal    the same with √(2 / (fan_in + fan_out))
  glorot_uniform   uniform in ±√(6 / (fan_in + fan_out)): Keras's default kernel initialiser
  random_uniform   uniform in [-0.05, 0.05]: Keras's RandomUniform defaults
"""

from __future__ import annotations

import math
from typing import Literal

import torch

TRUNCATION_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2]
Initializer = Literal["he_normal", "glorot_normal", "glorot_uniform", "random_uniform", "zeros", "ones"]


def keras_fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) of a kernel of Keras shape `shape`, as Keras computes them."""
    if len(shape) < 1:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


@torch.no_grad()
def keras_init_(tensor: torch.Tensor, kind: Initializer, keras_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Fill `tensor` in place as Keras's initialiser `kind` would fill a weight of `keras_shape` (default: the
    tensor's own shape). The values are drawn from torch's global generator."""
    fan_in, fan_out = keras_fans(tuple(keras_shape if keras_shape is not None else tensor.shape))
    if kind in ("he_normal", "glorot_normal"):
        n = fan_in if kind == "he_normal" else (fan_in + fan_out) / 2
        std = math.sqrt((2.0 if kind == "he_normal" else 1.0) / n) / TRUNCATION_STD
        return torch.nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)
    if kind == "glorot_uniform":
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return torch.nn.init.uniform_(tensor, -limit, limit)
    if kind == "random_uniform":
        return torch.nn.init.uniform_(tensor, -0.05, 0.05)
    if kind == "zeros":
        return torch.nn.init.zeros_(tensor)
    if kind == "ones":
        return torch.nn.init.ones_(tensor)
    raise ValueError(f"unknown Keras initialiser {kind!r}")


def conv_keras_shape(weight: torch.Tensor) -> tuple[int, int, int, int]:
    """A PyTorch Conv2d weight [out, in / groups, kh, kw] as its Keras kernel shape [kh, kw, in / groups, out]."""
    out, per_group, kh, kw = weight.shape
    return kh, kw, per_group, out


__all__ = ["Initializer", "conv_keras_shape", "keras_fans", "keras_init_"]
