"""Data: one module per source format (IDX, .npz, CIFAR, SVHN, smallNORB, image folders; `sources` picks one by
content), downloads, augmentation (`augment`: geometric; `imageaug`: natural images and each set's defaults) and
batching.

May import: torch, numpy and the foundation modules (errors, fileio, config); never nn, routing, models or above.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .augment import affine_warp, place_on_canvas, random_affine, random_shift
    from .batching import iterate_batches, num_batches, shard_indices
    from .datasets import load_dataset, resolve
    from .download import BUNDLED, DATASETS, FILE_NAMES, cache_root
    from .folder import load_folder
    from .idx import find_files, read_idx
    from .imageaug import AugmentSpec
    from .smallnorb import read_matrix
    from .sources import detect as detect_format
    from .split import Dataset, Split

# Each name imports its module at its first read (torch-free modules of the package load without torch).
__getattr__, __dir__ = lazy_attributes(
    __name__,
    {
        "affine_warp": "augment",
        "place_on_canvas": "augment",
        "random_affine": "augment",
        "random_shift": "augment",
        "iterate_batches": "batching",
        "num_batches": "batching",
        "shard_indices": "batching",
        "BUNDLED": "download",
        "load_dataset": "datasets",
        "resolve": "datasets",
        "DATASETS": "download",
        "FILE_NAMES": "download",
        "cache_root": "download",
        "load_folder": "folder",
        "find_files": "idx",
        "read_idx": "idx",
        "AugmentSpec": "imageaug",
        "read_matrix": "smallnorb",
        "detect_format": "sources:detect",
        "Dataset": "split",
        "Split": "split",
    },
)

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
]
