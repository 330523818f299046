"""Image files (PNG, JPEG, ...) into model inputs; Pillow is an optional extra (`capsnet[images]`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CapsNetError, DatasetError
from ..limits import MAX_IMAGE_PIXELS
from ..pixels import to_float
from .mnist_form import mnist_form


def _open_image(path: str | Path | Any, channels: int):
    """The image at `path` (or a Pillow image given as it is) as a Pillow image in mode L (channels 1) or RGB;
    DatasetError if it is not readable."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise CapsNetError("capsnet predict needs Pillow: pip install 'capsnet[images]'") from None
    if isinstance(path, Image.Image):
        check_pixels("an image", path.size)
        return flatten_alpha(path).convert("L" if channels == 1 else "RGB")
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # (check_pixels is the stricter guard)
            with Image.open(path) as im:
                check_pixels(path, im.size)  # (from the header, before decoding)
                im.load()
                return flatten_alpha(im).convert("L" if channels == 1 else "RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise DatasetError(f"{path}: not a readable image ({e})") from None


def flatten_alpha(im: Any) -> Any:
    """A Pillow image with transparency (RGBA, LA, or a palette with a transparent colour) laid on opaque paper that
    contrasts with what it holds: white under dark strokes, black under light ones (by the alpha-weighted mean
    luminance of its pixels); an image without transparency as it is. Dropping the alpha instead would leave the
    colour under the transparent pixels, often black, and a dark digit drawn on a transparent canvas would vanish."""
    from PIL import Image

    if not (im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info)):
        return im
    rgba = im.convert("RGBA")
    alpha = np.asarray(rgba.getchannel("A"), dtype=np.float64)
    grey = np.asarray(rgba.convert("L"), dtype=np.float64)
    mean = float((grey * alpha).sum() / alpha.sum()) if alpha.any() else 0.0  # Σ luminance·alpha / Σ alpha
    paper = Image.new("RGBA", rgba.size, (0, 0, 0, 255) if mean >= 128 else (255, 255, 255, 255))
    return Image.alpha_composite(paper, rgba).convert("RGB")


def check_pixels(path: str | Path, size: tuple[int, int]) -> None:
    """DatasetError if an image of `size` (W, H) has more pixels than MAX_IMAGE_PIXELS: decoding it could take
    gigabytes (a decompression bomb: a small file declaring a huge image)."""
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise DatasetError(
            f"{path}: {size[0]}×{size[1]} pixels is more than the {MAX_IMAGE_PIXELS:,} an image may "
            "have (MAX_IMAGE_PIXELS)"
        )


def _to_tensor(img, height: int, width: int, channels: int) -> torch.Tensor:
    """A Pillow image of `height` × `width` into [C, H, W] in [0, 1]."""
    x = to_float(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8))
    return x.view(height, width, channels).permute(2, 0, 1).contiguous()


def image_hw(path: str | Path) -> tuple[int, int]:
    """(height, width) of the image file at `path`; DatasetError if it is not readable."""
    width, height = _open_image(path, 1).size
    return height, width


def load_image(path: str | Path, *, size: int = 28, channels: int = 1) -> torch.Tensor:
    """Read a picture of a digit into the model's input [C, size, size] in [0, 1], MNIST-style: LeCun et al.'s
    procedure (`capsnet.data.mnist_form.mnist_form`): the paper and its uneven light removed, the ink kept,
    cropped to it, fitted in a 20/28 box keeping its aspect and centred by its centre of mass, white on black
    (three channels: the same grey in each). Its pixels are rounded to 0..255, as an image file's are."""
    digit = mnist_form(_open_image(path, 1), size=size)  # [size, size] in [0, 1]
    pixels = torch.from_numpy(np.round(digit * 255).astype(np.uint8))
    return to_float(pixels).expand(channels, size, size).contiguous()


def load_image_resized(path: str | Path, *, size: tuple[int, int], channels: int) -> torch.Tensor:
    """Read an image into [C, H, W] in [0, 1] as the image-folder reader converts training images: mode to L or
    RGB, resized (bilinear) to `size` (H, W). No inversion or boxing (that is `load_image`, for digits). A model
    of other than 1 or 3 channels (smallNORB's stereo pair: 2) reads the image's grey in each of them."""
    from PIL import Image

    read = channels if channels in (1, 3) else 1
    img = _open_image(path, read)
    if img.size != (size[1], size[0]):
        img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return _to_tensor(img, size[0], size[1], read).expand(channels, *size).contiguous()
