"""The limits every reader checks its input against, before it allocates: one named value for each.

A file or a setting beyond one of these is refused with one line (a CapsNetError), never a multi-gigabyte
allocation, an out-of-memory kill or a hang. Each value is far above what any real data set, model or server uses,
and low enough that a few bytes of hostile input cannot claim the machine. docs/security.md lists them.

May import: nothing in capsnet (a foundation module).
"""

from __future__ import annotations

# Config files (config.json, YAML --config, card.json): a real one is a few KB.
CONFIG_FILE_BYTES = 1 << 20  # 1 MiB
# Model and data-set sizes a config or a data file may declare. ImageNet has 1,000 classes; 100,000 leaves room.
MAX_CLASSES = 100_000
# The side of an input image a model or an image folder may be built for (an image of 4096 × 4096 pixels).
MAX_IMAGE_SIDE = 4096
# Parameters of a model a config.json describes (counted on the meta device before it is built): 500 million,
# 2 GB of float32; the largest model here has about 25 million.
MAX_PARAMETERS = 500_000_000
# Bytes of one image uploaded to `capsnet explore`'s page: a photograph is a few MB.
MAX_UPLOAD_BYTES = 10 << 20  # 10 MiB
# Pixels of one image file decoded (Pillow's decompression-bomb guard): 64 megapixels, a 8000 × 8000 photograph.
MAX_IMAGE_PIXELS = 64_000_000
# Elements of one array a data file or a weights file may declare: 4 × 10^9 (e.g. 4 GB of uint8 images), and at
# most this many times the file's own size (compression: a .npz / .h5 / gzip stores zeros in few bytes).
MAX_ARRAY_ELEMENTS = 4_000_000_000
MAX_EXPANSION = 1000
# Downloads: the bytes one file may have (the largest data-set archive, SVHN's extra split, is 1.3 GB), those of a
# config.json, and how long one download may take in all (every try, every read) before it is abandoned.
MAX_DOWNLOAD_BYTES = 4 << 30  # 4 GiB
MAX_CONFIG_DOWNLOAD_BYTES = CONFIG_FILE_BYTES
DOWNLOAD_DEADLINE_S = 3600.0  # a whole data set on a slow link
CONFIG_DOWNLOAD_DEADLINE_S = 120.0  # a few KB
# The low-speed limit of every download (curl's --speed-limit / --speed-time): a body that arrives slower than
# DOWNLOAD_LOW_SPEED_BYTES_S bytes a second for DOWNLOAD_LOW_SPEED_S seconds makes no real progress, and the try
# ends then rather than at the deadline. 1 KB/s is a thousandth of a slow broadband link.
DOWNLOAD_LOW_SPEED_BYTES_S = 1024
DOWNLOAD_LOW_SPEED_S = 30.0
# Files of a Hugging Face Hub repository listed before its model is downloaded (`hf-hub:` references): a capsnet
# repository holds three; a listing that goes on past this many entries is refused.
MAX_HUB_FILES = 10_000


def array_too_large(elements: int, itemsize: int, file_bytes: int) -> str | None:
    """Why an array of `elements` items of `itemsize` bytes, declared by a file of `file_bytes` bytes, is refused
    (more than MAX_ARRAY_ELEMENTS, or more than MAX_EXPANSION times the file's size); None when it may be read."""
    if elements > MAX_ARRAY_ELEMENTS:
        return f"{elements:,} values is more than the {MAX_ARRAY_ELEMENTS:,} one array may have (MAX_ARRAY_ELEMENTS)"
    if elements * itemsize > MAX_EXPANSION * max(file_bytes, 1 << 20):
        return (
            f"{elements * itemsize:,} bytes declared by a file of {file_bytes:,} bytes (more than "
            f"{MAX_EXPANSION} times its size: MAX_EXPANSION)"
        )
    return None


__all__ = [
    "CONFIG_DOWNLOAD_DEADLINE_S",
    "CONFIG_FILE_BYTES",
    "DOWNLOAD_DEADLINE_S",
    "DOWNLOAD_LOW_SPEED_BYTES_S",
    "DOWNLOAD_LOW_SPEED_S",
    "MAX_ARRAY_ELEMENTS",
    "MAX_CLASSES",
    "MAX_CONFIG_DOWNLOAD_BYTES",
    "MAX_DOWNLOAD_BYTES",
    "MAX_EXPANSION",
    "MAX_HUB_FILES",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "MAX_PARAMETERS",
    "array_too_large",
]
