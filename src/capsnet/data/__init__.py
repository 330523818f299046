"""Data: one module per source format (IDX, image files), downloads, augmentation and batching.

May import: torch, numpy and the foundation modules (errors, fileio, config); never nn, routing, models or above.
"""

from .augment import random_affine, random_shift
from .batching import iterate_batches, num_batches
from .datasets import BUNDLED, load_dataset, resolve
from .download import DATASETS, FILE_NAMES, cache_root
from .idx import find_files, read_idx
from .split import Dataset, Split

__all__ = [
    "BUNDLED",
    "DATASETS",
    "FILE_NAMES",
    "Dataset",
    "Split",
    "cache_root",
    "find_files",
    "iterate_batches",
    "load_dataset",
    "num_batches",
    "random_affine",
    "random_shift",
    "read_idx",
    "resolve",
]
