"""Image augmentation for natural images, vectorized over the batch on its device, and each set's defaults.

Every function takes float images [B, C, H, W] and a `torch.Generator` (random numbers are drawn on the
generator's device, then moved to the images'), so a seeded generator gives the same result on every run; at zero
strength each is the identity. `AugmentSpec` combines them in the order of the official CapsNet code's
CIFAR-10 input pipeline (github.com/Sarasra/models, research/capsules/input_data/cifar10): random crop, flip,
brightness, contrast; then (in the model: `standardize`) per-image standardization. At test time the images are
centre-cropped to the crop size (`center_crop`, applied by the model's input recipe, capsnet.models.recipe).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from . import hvc_augment
from .augment import affine_warp, random_shift
from .colour import ColourCheck


def _draw(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) numbers drawn on the generator's device, moved to `device`."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def random_crop(x: torch.Tensor, size: tuple[int, int], *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each image's own random size[0]×size[1] window (one gather for the batch). x [B, C, H, W] -> [B, C, h, w]."""
    b, _, h, w = x.shape
    ch, cw = size
    if ch > h or cw > w:
        raise ValueError(f"crop {ch}x{cw} is larger than the images ({h}x{w})")
    if (ch, cw) == (h, w):
        return x
    r = _draw((2, b), generator, x.device)
    top = (r[0] * (h - ch + 1)).long().clamp_max(h - ch)
    left = (r[1] * (w - cw + 1)).long().clamp_max(w - cw)
    rows = top[:, None] + torch.arange(ch, device=x.device)  # [B, ch]
    cols = left[:, None] + torch.arange(cw, device=x.device)  # [B, cw]
    batch = torch.arange(b, device=x.device)[:, None, None]
    return x.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


def center_crop(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The central size[0]×size[1] window (the test-time counterpart of `random_crop`)."""
    h, w = x.shape[-2:]
    ch, cw = size
    if ch > h or cw > w:
        raise ValueError(f"crop {ch}x{cw} is larger than the images ({h}x{w})")
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[..., top : top + ch, left : left + cw]


def random_flip(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    flip = _draw((x.shape[0],), generator, x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def random_colour(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Each image's channels in a random order of their own, then inverted (1 − x) with probability 1/2: colours
    change and the shapes stay. x [B, C, H, W] in [0, 1]."""
    b, c = x.shape[:2]
    order = _draw((b, c), generator, x.device).argsort(dim=1)  # a random permutation per image  [B, C]
    x = x.gather(1, order[:, :, None, None].expand_as(x))
    invert = _draw((b,), generator, x.device) < 0.5
    return torch.where(invert[:, None, None, None], 1 - x, x)


def random_brightness(x: torch.Tensor, max_delta: float, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Add one delta per image drawn from [-max_delta, max_delta] (tf.image.random_brightness); 0: identity."""
    if max_delta == 0:
        return x
    delta = (_draw((x.shape[0],), generator, x.device) * 2 - 1) * max_delta
    return x + delta.to(x.dtype)[:, None, None, None]


def random_contrast(
    x: torch.Tensor, lower: float, upper: float, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(x - mean) · f + mean per image and channel, f drawn from [lower, upper] per image
    (tf.image.random_contrast); lower = upper = 1: identity."""
    if lower == upper == 1:
        return x
    f = (lower + _draw((x.shape[0],), generator, x.device) * (upper - lower)).to(x.dtype)[:, None, None, None]
    mean = x.mean(dim=(2, 3), keepdim=True)
    return (x - mean) * f + mean


def random_rotate_zoom(
    x: torch.Tensor, degrees: float, zoom: tuple[float, float], *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Rotate each image about its centre by an angle drawn from [-degrees, degrees] and scale it by a factor drawn
    from [zoom[0], zoom[1]] (bilinear, zero outside); degrees 0 and zoom (1, 1): identity."""
    lo, hi = zoom
    if degrees == 0 and lo == hi == 1:
        return x
    r = _draw((2, x.shape[0]), generator, x.device)
    angle = torch.deg2rad((r[0] * 2 - 1) * degrees)
    factor = lo + r[1] * (hi - lo)
    cos, sin = torch.cos(angle) * factor, torch.sin(angle) * factor  # M = factor · rotation  [B]
    matrix = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # [B, 2, 2]
    return affine_warp(x, matrix)


@dataclass(frozen=True)
class AugmentSpec:
    """One data set's augmentation. Written and parsed as a comma list, e.g. "crop=24,flip,brightness=0.247,
    contrast=0.2:1.8,standardize" or "shift=2" or "none"."""

    shift: int = 0  # random translation of up to N px (the paper's §5), filled with each image's border colour
    zero_fill: bool = False  # shifts filled with zeros instead (the paper's words; the same on MNIST)
    crop: tuple[int, int] | None = None  # random crop to H×W in training, centre crop at test
    flip: bool = False  # random left-right mirror (never for digits)
    # random channel order and inversion, for sets whose classes are shapes in any colours (not the paper's)
    colour: bool = False
    brightness: float = 0.0  # max |delta|, in units of the [0, 1] range
    contrast: tuple[float, float] = (1.0, 1.0)  # range of the contrast factor
    standardize: bool = False  # per-image standardization (done by the model: its config records it)
    divisor: float = 255.0  # uint8 pixels are divided by this (Efficient-CapsNet's MNIST code: 256)
    # Per-channel standardization with the split's own statistics, before the crops (capsnet.data.scaling; the
    # Efficient-CapsNet code's smallNORB input). Brightness is then in standard deviations, and nothing is clipped.
    channel_standardize: bool = False
    rotate: float = 0.0  # random rotation of up to ± this many degrees (not the paper's)
    zoom: tuple[float, float] = (1.0, 1.0)  # range of a random scale factor (not the paper's)
    # Byerly et al.'s MNIST augmentation (capsnet.data.hvc_augment), applied first; "hvc" sets all four
    hvc_rotate: float = 0.0  # rotate half the images by up to ± this many degrees (normal draws)
    hvc_shift: bool = False  # translate within the object's empty margins
    hvc_squish: int = 0  # narrow by up to this many pixels
    hvc_erase: int = 0  # zero a random square patch of this side

    def __post_init__(self) -> None:
        if self.rotate < 0 or not 0 < self.zoom[0] <= self.zoom[1]:
            raise ConfigError(f"augmentation {self}: need rotate >= 0 and 0 < zoom lo <= hi")
        if min(self.hvc_rotate, self.hvc_squish, self.hvc_erase) < 0:
            raise ConfigError(f"augmentation {self}: need hvc-rotate, hvc-squish and hvc-erase >= 0")
        if self.channel_standardize and (self.hvc_rotate or self.hvc_shift or self.hvc_squish or self.hvc_erase):
            raise ConfigError(f"augmentation {self}: the hvc items work on [0, 1] images, not with channel-standardize")
        lo, hi = self.contrast
        if self.shift < 0 or self.brightness < 0 or not 0 <= lo <= hi:
            raise ConfigError(f"augmentation {self}: need shift >= 0, brightness >= 0 and 0 <= contrast lo <= hi")
        if self.colour and self.channel_standardize:
            raise ConfigError(f"augmentation {self}: colour inverts [0, 1] images, not with channel-standardize")
        if self.crop is not None and min(self.crop) < 1:
            raise ConfigError(f"augmentation crop must be positive, got {self.crop}")
        if not self.divisor > 0:
            raise ConfigError(f"augmentation divisor must be > 0, got {self.divisor}")

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The training augmentation of a float batch [B, C, H, W] in [0, 1], the result clamped to [0, 1]; with
        `channel_standardize`, of a standardized batch, not clamped (as the Efficient-CapsNet code)."""
        lo, hi = (-torch.inf, torch.inf) if self.channel_standardize else (0.0, 1.0)
        if self.hvc_rotate or self.hvc_shift or self.hvc_squish or self.hvc_erase:
            x = hvc_augment.hvc_augment(
                x,
                rotate=self.hvc_rotate,
                shift=self.hvc_shift,
                squish=self.hvc_squish,
                erase=self.hvc_erase,
                generator=generator,
            )
        if self.crop is not None:
            x = random_crop(x, self.crop, generator=generator)
        if self.rotate or self.zoom != (1.0, 1.0):
            x = random_rotate_zoom(x, self.rotate, self.zoom, generator=generator).clamp_(lo, hi)
        if self.shift:
            x = random_shift(x, self.shift, generator=generator, fill="zero" if self.zero_fill else "border")
        if self.flip:
            x = random_flip(x, generator=generator)
        if self.colour:
            x = random_colour(x, generator=generator)
        if self.brightness or self.contrast != (1.0, 1.0):
            x = random_brightness(x, self.brightness, generator=generator)
            x = random_contrast(x, *self.contrast, generator=generator).clamp_(lo, hi)
        return x

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The size of the augmented (and of the centre-cropped test) images for inputs of height × width."""
        if self.crop is not None and (self.crop[0] > height or self.crop[1] > width):
            raise ConfigError(
                f"augmentation crop {self.crop[0]}x{self.crop[1]} is larger than the {height}x{width} images"
            )
        return self.crop if self.crop is not None else (height, width)

    def __str__(self) -> str:
        parts = []
        hvc = {"rotate": self.hvc_rotate, "shift": self.hvc_shift, "squish": self.hvc_squish, "erase": self.hvc_erase}
        if hvc == hvc_augment.PAPER:
            parts.append("hvc")
        else:
            parts += [f"hvc-rotate={self.hvc_rotate:g}"] if self.hvc_rotate else []
            parts += ["hvc-shift"] if self.hvc_shift else []
            parts += [f"hvc-{k}={v}" for k, v in (("squish", self.hvc_squish), ("erase", self.hvc_erase)) if v]
        if self.crop is not None:
            parts.append(f"crop={self.crop[0]}x{self.crop[1]}")
        if self.rotate:
            parts.append(f"rotate={self.rotate:g}")
        if self.zoom != (1.0, 1.0):
            parts.append(f"zoom={self.zoom[0]:g}:{self.zoom[1]:g}")
        if self.shift:
            parts.append(f"shift={self.shift}")
        if self.zero_fill:
            parts.append("zero-fill")
        if self.flip:
            parts.append("flip")
        if self.colour:
            parts.append("colour")
        if self.brightness:
            parts.append(f"brightness={self.brightness:.6g}")
        if self.contrast != (1.0, 1.0):
            parts.append(f"contrast={self.contrast[0]:g}:{self.contrast[1]:g}")
        if self.standardize:
            parts.append("standardize")
        if self.divisor != 255:
            parts.append(f"divisor={self.divisor:g}")
        if self.channel_standardize:
            parts.append("channel-standardize")
        return ",".join(parts) or "none"

    @classmethod
    def parse(cls, text: str) -> AugmentSpec:
        """The inverse of str(): "none", or a comma list of shift=N, zero-fill, crop=H[xW], flip, colour, brightness=D,
        contrast=LO:HI, rotate=DEG, zoom=LO:HI, standardize, divisor=D, channel-standardize, and Byerly et al.'s
        hvc (= hvc-rotate=30, hvc-shift, hvc-squish=7, hvc-erase=4)."""
        spec: dict = {}
        for item in (t.strip() for t in text.split(",")):
            key, _, value = item.partition("=")
            try:
                if item in ("", "none"):
                    continue
                if item == "hvc":
                    spec.update({f"hvc_{k}": v for k, v in hvc_augment.PAPER.items()})
                elif (
                    key in ("flip", "colour", "standardize", "channel-standardize", "hvc-shift", "zero-fill")
                    and not value
                ):
                    spec[key.replace("-", "_")] = True
                elif key in ("hvc-squish", "hvc-erase"):
                    spec[key.replace("-", "_")] = int(value)
                elif key == "hvc-rotate":
                    spec["hvc_rotate"] = float(value)
                elif key == "shift":
                    spec["shift"] = int(value)
                elif key == "crop":
                    sides = [int(v) for v in value.lower().split("x")]
                    spec["crop"] = (sides[0], sides[-1]) if len(sides) <= 2 else None
                    if spec["crop"] is None:
                        raise ValueError(value)
                elif key in ("brightness", "divisor"):
                    spec[key] = float(value)
                elif key in ("contrast", "zoom"):
                    lo, hi = value.split(":")
                    spec[key] = (float(lo), float(hi))
                elif key == "rotate":
                    spec["rotate"] = float(value)
                else:
                    raise ValueError(item)
            except ValueError:
                raise ConfigError(
                    f"augmentation {text!r}: cannot read {item!r}; use none or a comma list of shift=N, zero-fill, "
                    "crop=H[xW], "
                    "flip, colour, brightness=D, contrast=LO:HI, rotate=DEG, zoom=LO:HI, standardize, divisor=D, "
                    "channel-standardize, hvc (or hvc-rotate=DEG, hvc-shift, hvc-squish=N, hvc-erase=N)"
                ) from None
        return cls(**spec)

    def replace(self, **changes) -> AugmentSpec:
        return dataclasses.replace(self, **changes)


# The defaults per data set format, following the official TensorFlow code (github.com/Sarasra/models,
# research/capsules/input_data): CIFAR-10 random 24×24 crops, left-right flips, brightness ±63/255, contrast
# 0.2–1.8, 24×24 centre crops at test, per-image standardization; smallNORB (48×48 after loading) random 32×32
# crops, centre crops at test; SVHN and the MNIST family the paper's 2 px shifts. CIFAR-100 takes CIFAR-10's.
# Image folders and .npz files: 2 px shifts (nothing that assumes what the images show), and the colour augmentation
# where their colours do not tell the classes apart (OWN_KINDS, capsnet.data.colour).
OWN_KINDS = ("folder", "npz")
DEFAULTS: dict[str, AugmentSpec] = {
    "cifar10": AugmentSpec(crop=(24, 24), flip=True, brightness=63 / 255, contrast=(0.2, 1.8), standardize=True),
    "cifar100": AugmentSpec(crop=(24, 24), flip=True, brightness=63 / 255, contrast=(0.2, 1.8), standardize=True),
    # research/capsules norb_input_record.py (and capsule_em's): brightness, contrast, random 32×32 crop, per-image
    # standardisation in training; the centre crop, standardised, at test
    "smallnorb": AugmentSpec(crop=(32, 32), brightness=63 / 255, contrast=(0.2, 1.8), standardize=True),
    "svhn": AugmentSpec(shift=2),
    "idx": AugmentSpec(shift=2),
    "npz": AugmentSpec(shift=2),
    "folder": AugmentSpec(shift=2),
}


def resolve_augment(
    text: str,
    kind: str,
    *,
    shift: int = 2,
    recipes: dict[str, dict[str, str]] | None = None,
    colours: ColourCheck | None = None,
) -> AugmentSpec:
    """ "auto": the model's own recipe for data format `kind` (`recipes`, a model class's `data_recipes`), else
    the format's default, its 2 px shift replaced by `shift` (TrainConfig.shift), with colour on a format of one's
    own (OWN_KINDS) whose training split's `colours` do not tell its classes apart; otherwise
    `AugmentSpec.parse`."""
    if text != "auto":
        return AugmentSpec.parse(text)
    recipe = (recipes or {}).get(kind, {}).get("augment")
    if recipe is not None:
        spec = AugmentSpec.parse(recipe)
    else:
        spec = DEFAULTS.get(kind, DEFAULTS["folder"])
        if kind in OWN_KINDS and colours is not None and colours.colour_free:
            spec = spec.replace(colour=True)
    return spec.replace(shift=shift) if spec.shift else spec
