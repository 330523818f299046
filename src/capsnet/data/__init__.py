"""Data: one module per source format (IDX, .npz, CIFAR, SVHN, smallNORB, image folders; `sources` picks one by
content), downloads, augmentation (`augment`: geometric; `imageaug`: natural images and each set's defaults) and
batching.

May import: torch, numpy and the foundation modules (errors, fileio, config); never nn, routing, models or above.
"""

from .augment import affine_warp, place_on_canvas, random_affine, random_shift
from .batching import iterate_batches, num_batches, shard_indices
from .datasets import BUNDLED, load_dataset, resolve
from .download import DATASETS, FILE_NAMES, cache_root
from .folder import load_folder
from .idx import find_files, read_idx
from .imageaug import AugmentSpec
from .smallnorb import read_matrix
from .sources import detect as detect_format
from .split import Dataset, Split, to_float

__all__ = [
    "BUNDLED",
    "DATASETS",
    "FILE_NAMES",
    "AugmentSpec",
    "Dataset",
    "Split",
    "affine_warp",
    "cache_root",
    "detect_format",
    "find_files",
    "iterate_batches",
    "load_dataset",
    "load_folder",
    "num_batches",
    "place_on_canvas",
    "random_affine",
    "random_shift",
    "read_idx",
    "read_matrix",
    "resolve",
    "shard_indices",
    "to_float",
]
