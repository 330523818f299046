"""Image files (PNG, JPEG, ...) into model inputs; Pillow is an optional extra (`capsnet[images]`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..errors import CapsNetError, DatasetError
from ..limits import MAX_IMAGE_PIXELS
from ..pixels import to_float


def _open_image(path: str | Path, channels: int):
    """The image at `path` as a Pillow image in mode L (channels 1) or RGB; DatasetError if it is not readable."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise CapsNetError("capsnet predict needs Pillow: pip install 'capsnet[images]'") from None
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # (check_pixels is the stricter guard)
            with Image.open(path) as im:
                check_pixels(path, im.size)  # (from the header, before decoding)
                im.load()
                return im.convert("L" if channels == 1 else "RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise DatasetError(f"{path}: not a readable image ({e})") from None


def check_pixels(path: str | Path, size: tuple[int, int]) -> None:
    """DatasetError if an image of `size` (W, H) has more pixels than MAX_IMAGE_PIXELS: decoding it could take
    gigabytes (a decompression bomb: a small file declaring a huge image)."""
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise DatasetError(f"{path}: {size[0]}×{size[1]} pixels is more than the {MAX_IMAGE_PIXELS:,} an image may "
                           "have (MAX_IMAGE_PIXELS)")  # fmt: skip


def _to_tensor(img, height: int, width: int, channels: int) -> torch.Tensor:
    """A Pillow image of `height` × `width` into [C, H, W] in [0, 1]."""
    x = to_float(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8))
    return x.view(height, width, channels).permute(2, 0, 1).contiguous()


def image_hw(path: str | Path) -> tuple[int, int]:
    """(height, width) of the image file at `path`; DatasetError if it is not readable."""
    width, height = _open_image(path, 1).size
    return height, width


def load_image(path: str | Path, *, size: int = 28, channels: int = 1) -> torch.Tensor:
    """Read an image into the model's input [C, size, size] in [0, 1], MNIST-style.

    Light-background images (dark ink on white paper) are inverted to MNIST's white-on-black; the content is
    scaled to fit a box of 20/28 of the side, keeping its aspect ratio, and centred, as MNIST's digits are.
    """
    from PIL import Image, ImageOps

    img = _open_image(path, channels)
    gray = img if img.mode == "L" else img.convert("L")
    w, h = gray.size
    border = [gray.getpixel((x, y)) for x in range(w) for y in (0, h - 1)]
    border += [gray.getpixel((x, y)) for y in range(h) for x in (0, w - 1)]
    if sum(border) / len(border) > 127:  # light background: invert to white ink on black
        img = ImageOps.invert(img)
    inner = max(1, round(size * 20 / 28))
    scale = inner / max(w, h)
    img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)
    canvas = Image.new(img.mode, (size, size))
    canvas.paste(img, ((size - img.size[0]) // 2, (size - img.size[1]) // 2))
    return _to_tensor(canvas, size, size, channels)


def load_image_resized(path: str | Path, *, size: tuple[int, int], channels: int) -> torch.Tensor:
    """Read an image into [C, H, W] in [0, 1] as the image-folder reader converts training images: mode to L or
    RGB, resized (bilinear) to `size` (H, W). No inversion or boxing (that is `load_image`, for digits)."""
    from PIL import Image

    img = _open_image(path, channels)
    if img.size != (size[1], size[0]):
        img = img.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return _to_tensor(img, size[0], size[1], channels)
