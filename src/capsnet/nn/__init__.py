"""Capsule building blocks: the squash non-linearity, primary capsules, the decoder and the losses.

May import: torch and capsnet's foundation modules (errors, fileio, config) only.
"""

from .decoder import CapsuleDecoder, ConvCapsuleDecoder
from .losses import MarginLoss, capsule_lengths, reconstruction_loss
from .primary import PrimaryCapsules
from .squash import Squash, efficient_squash, squash

__all__ = [
    "CapsuleDecoder",
    "ConvCapsuleDecoder",
    "MarginLoss",
    "PrimaryCapsules",
    "Squash",
    "capsule_lengths",
    "efficient_squash",
    "reconstruction_loss",
    "squash",
]
