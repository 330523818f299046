"""The front door for inference: raw images to a model's input, predictions and scores; Ensemble of models.

    x = capsnet.preprocess(model, images)     # the model's input, through the recipe it records
    model(x)                                  # forward takes that input, and nothing else (docs/inputs.md)
    p = capsnet.predict(model, images)        # p.classes, p.names, p.lengths, p.capsules
    capsnet.evaluate(model, data)             # accuracy, per-class accuracy, confusion matrix

`images` is a uint8 tensor [B, C, H, W] (or one image [C, H, W]) of pixels p, a float tensor of x01 = p / 255, a PIL
image, a path, or a list of images or paths. Image files and PIL images are converted as `capsnet predict` converts
them (a digit model's digit-style conversion; another model's resize to the size it reads). `capsnet predict` and
`capsnet evaluate` call these; training's validation scores with the same evaluator (capsnet.training.evaluator).

A model that standardizes each channel (`channel_standardize`) is fed its recorded training statistics by
preprocess and predict (and the exported graph). Scoring a whole split, evaluate uses the split's own statistics
instead, as the Efficient-CapsNet authors' smallNORB evaluation does (the published figure); a Dataset or a
DataLoader, read once as a stream, gets the recorded ones.

Ensemble: several trained models as one, the average of their class probabilities (capsule lengths).

The paper's CIFAR-10 result (§7, 10.6% error) is "an ensemble of 7 models", each trained with the same setup;
`capsnet evaluate --checkpoint RUN1 --checkpoint RUN2 ...` evaluates such an ensemble with `Ensemble`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from .data.imageaug import center_crop
from .data.images import image_hw as image_file_hw
from .data.images import load_image, load_image_resized
from .data.mnist_form import IN_WORDS
from .data.scaling import channel_stats
from .data.split import Split
from .errors import CheckpointError, ConfigError, DatasetError
from .models.inputs import image_hw
from .models.pretrained import load_pretrained
from .models.recipe import InputRecipe, Stats, model_input, recipe_of
from .nn.losses import MarginLoss
from .training.checkpoint import resolve_checkpoint
from .training.checkpoint_data import check_split, checkpoint_data, data_conversions, recorded_data, scored
from .training.evaluator import evaluate_batches, input_config, standardizes_channels
from .training.hardware import resolve_device
from .training.loader import check_batch, check_example, is_dataset
from .training.tasks import Batch

ImageInput = Any  # a tensor [B, C, H, W] or [C, H, W] (uint8 pixels, or floats x01), a PIL image, a path, or a list


# ------------------------------------------------------------------------------------------------ preprocess
def preprocess(model: nn.Module, images: ImageInput, *, stats: Stats | None = None) -> torch.Tensor:
    """`images` as `model`'s input [B, C, H, W] on its device: what `model(x)` takes. Files and PIL images are
    converted as `capsnet predict` converts them; tensors are raw pixels (uint8, or floats x01 = p / 255); then the
    model's recorded recipe (capsnet.models.recipe: the centre crop, ÷ 255 or its recorded statistics)."""
    raw, _ = raw_images(model, images)
    return model_input(model, raw.to(model_device(model)), stats=stats)


def raw_images(model: nn.Module, images: ImageInput) -> tuple[torch.Tensor, list[str]]:
    """(raw images [B, C, H, W], uint8 or x01 floats on the CPU, and each one's conversion in words)."""
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise DatasetError("no images given")
    if len(items) == 1 and isinstance(items[0], torch.Tensor) and items[0].dim() == 4:
        return check_pixels(items[0]).cpu(), ["as given"] * items[0].shape[0]
    recipe = recipe_of(model)
    tensors, conversions = [], []
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.dim() != 3:
                raise DatasetError(f"an image tensor is [C, H, W] (a batch: [B, C, H, W]), got {list(item.shape)}")
            x, how = check_pixels(item).cpu(), "as given"
            x = x.float().div(255.0) if x.dtype == torch.uint8 else x  # (a list may mix uint8 and float images)
        else:
            if recipe.size is None or recipe.channels is None:
                raise ConfigError("a model that records no input size takes tensors, not image files")
            x, how = prepare_image(item, recipe)
        tensors.append(x)
        conversions.append(how)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise DatasetError(f"the images have different shapes {sorted(shapes)}; give them one size")
    return torch.stack(tensors), conversions


def check_pixels(images: torch.Tensor) -> torch.Tensor:
    """`images` if they are raw pixels: uint8 p, or floats x01 = p / 255 in [0, 1]; DatasetError otherwise (floats
    of 0..255 are the classic mistake: they would run and score near chance)."""
    if images.dtype == torch.uint8:
        return images
    if not images.is_floating_point():
        raise DatasetError(f"images of {images.dtype}: give uint8 pixels 0..255 or floats x01 = p / 255 in [0, 1]")
    if images.numel() and (float(images.min()) < 0 or float(images.max()) > 1):
        raise DatasetError(
            f"float images must be x01 = p / 255 in [0, 1], got values in [{float(images.min()):g}, "
            f"{float(images.max()):g}]; pass the uint8 pixels, or divide by 255"
        )
    return images


def model_device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


# ------------------------------------------------------------------------------------------------ predict
@dataclass
class Prediction:
    """What `predict` returns for B images."""

    classes: torch.Tensor  # the predicted class indices (int64) [B]
    names: list[str]  # their names, as the model records them from its training data (else the index)
    lengths: torch.Tensor  # the class capsules' lengths (a baseline's probabilities) [B, n_classes]
    capsules: torch.Tensor | None  # the class capsules [B, n_classes, D] (None: a model without them)
    conversions: list[str]  # how each image was converted, in words

    def rows(self, images: list[Any] | None = None) -> list[dict[str, Any]]:
        """One dict per image: {"image", "class", "name", "lengths", "conversion"} (`capsnet predict --json`)."""
        images = images if images is not None else [None] * len(self.names)
        return [
            {
                "image": None if im is None else str(im),
                "class": int(c),
                "name": name,
                "lengths": [round(float(x), 6) for x in row],
                "conversion": how,
            }
            for im, c, name, row, how in zip(
                images, self.classes.tolist(), self.names, self.lengths.tolist(), self.conversions
            )
        ]


@torch.no_grad()
def predict(model: nn.Module, images: ImageInput) -> Prediction:
    """The class of each image (see the module's docstring for what `images` may be), in eval mode. A model that
    standardizes each channel is fed its recorded training statistics (a DatasetError when it records none)."""
    for member in model.modules():  # single images need a standardizing model's recorded training statistics
        if getattr(getattr(member, "config", None), "channel_standardize", False):
            InputRecipe.from_config(member.config).statistics()
    raw, conversions = raw_images(model, images)
    x = model_input(model, raw.to(model_device(model)))
    was_training = model.training
    model.eval()
    try:
        out = model(x)
    finally:
        model.train(was_training)
    classes = out.predictions.long().cpu()
    capsules = getattr(out, "capsules", None)
    return Prediction(
        classes=classes,
        names=[class_name(getattr(model, "config", None), int(k)) for k in classes],
        lengths=out.lengths.float().cpu(),
        capsules=None if capsules is None else capsules.cpu(),
        conversions=conversions,
    )


# ------------------------------------------------------------------------------------------------ evaluate
def evaluate(
    model: nn.Module, data: Any, *, batch_size: int = 250, device: str | torch.device | None = None
) -> dict[str, Any]:
    """Accuracy, per-class accuracy ("per_class"), the confusion matrix (rows: true class), "loss" and "n" of
    `model` on `data`: a Split, a Dataset of (image, label) examples, or an iterable of (images, labels) batches such
    as a DataLoader. Images are raw pixels (uint8, or floats x01); each batch goes through the model's recipe (a
    Split that a channel-standardizing model reads: with its own statistics). `device`: the model's by default."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    dev = resolve_device(str(device)) if device is not None else model_device(model)
    cfg = input_config(model)
    if isinstance(data, Split):
        n_classes = cfg.n_classes if cfg is not None else int(data.labels.max()) + 1 if len(data) else 1
        stats = channel_stats(data) if standardizes_channels(model) else None  # (the split's own, as the authors')
        images, labels = data.images, data.labels
        batches: Any = (
            (images[k : k + batch_size], labels[k : k + batch_size]) for k in range(0, len(labels), batch_size)
        )
    else:
        if cfg is None:
            raise ConfigError("evaluate: a model that records no classes (n_classes) is scored on a Split")
        n_classes, stats, batches = cfg.n_classes, None, _batches(data, batch_size)
    prepared = (Batch(model_input(model, check_pixels(x).to(dev), stats=stats), y.to(dev)) for x, y in batches)
    return evaluate_batches(model, prepared, device=dev, n_classes=n_classes)


def _batches(data: Any, batch_size: int):
    """(images, labels) batches of a Dataset of examples (`batch_size` at a time) or of an iterable of batches."""
    if is_dataset(data):
        for start in range(0, len(data), batch_size):
            items = [data[k] for k in range(start, min(start + batch_size, len(data)))]
            for k, item in enumerate(items):
                check_example(item, f"data[{start + k}]")
            yield torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items])
        return
    for k, batch in enumerate(data):
        yield check_batch(batch, f"batch {k}")


def evaluate_checkpoint(
    checkpoint: str | os.PathLike | list[str | os.PathLike],
    *,
    dataset: str | None = None,
    data_dir: str | None = None,
    split: str = "test",
    batch_size: int = 250,
    device: str = "cpu",
) -> dict:
    """Load a run folder or save_pretrained folder and evaluate it on a data set split. Several checkpoints are
    evaluated as one `Ensemble` (their capsule lengths averaged).

    The data set defaults to the one the checkpoint records (`recorded_data`); `dataset` / `data_dir` choose
    another. Image folders are converted as for training: to the size the model recorded (before its crops) and
    channels. `device`: cpu, cuda, cuda:K or auto."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    paths = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    folders = [resolve_checkpoint(c) for c in paths]
    models = [load_pretrained(f, map_location=resolve_device(device)) for f in folders]
    model = models[0] if len(models) == 1 else Ensemble(models)
    cfg: Any = model.config
    data = checkpoint_data(model, paths, dataset=dataset, data_dir=data_dir, n_classes=cfg.n_classes)
    chosen = data.test if split == "test" else data.train
    if chosen is None:
        raise DatasetError(f"{data.source}: has no {split} split")
    conversions = data_conversions(cfg, data.source, data)
    record = recorded_data(paths[0]) if dataset is None and data_dir is None else None
    n = record.get("test_subset") if record is not None and split == "test" else None
    if n is not None:  # the subset the run's test.json scored
        chosen = Split(chosen.images[:n], chosen.labels[:n], chosen.channel_stats)
        conversions.append(f"the first {n} test images, as the run scored (its --test-subset)")
    check_split(model, chosen, source=data.source)
    result = evaluate(model, chosen, batch_size=batch_size, device=resolve_device(device))
    result["conversions"] = conversions
    result.update(
        checkpoint=str(paths[0]) if len(paths) == 1 else [str(p) for p in paths],
        dataset=data.name,
        split=split,
        class_names=[class_name(cfg, k) for k in range(cfg.n_classes)],
        scored=[scored(f) for f in folders],
    )
    return result


# ------------------------------------------------------------------------------------------------ image files
def fit_to_model(x: torch.Tensor, cfg) -> torch.Tensor:
    """Centre-crop images [B, C, H, W] larger than the model's input to its size (the test-time counterpart of
    training on random crops); images of the model's size pass unchanged."""
    h, w = image_hw(cfg.image_size)
    return x if tuple(x.shape[-2:]) == (h, w) else center_crop(x, (h, w))


def prepare_image(path: Any, cfg: Any) -> tuple[torch.Tensor, str]:
    """One image file (or PIL image) as raw input [C, H, W] in [0, 1] for the model's recipe, and the conversion
    applied in words.

    A model trained on digit-style images (`digits`) gets MNIST's form: an image of its input size with a dark
    background is taken as it is; any other (a photo of ink on paper, say) goes through LeCun et al.'s MNIST
    procedure (capsnet.data.mnist_form.mnist_form). Any other model gets the image converted (L or RGB) and resized
    as the image-folder reader converts training images, to its size before cropping (the recipe then centre-crops
    it)."""
    recipe = cfg if isinstance(cfg, InputRecipe) else InputRecipe.from_config(cfg)  # (a model config, or a recipe)
    assert recipe.size is not None and recipe.channels is not None
    (h, w), native = recipe.size, image_file_hw(path)
    if recipe.digits:
        if h != w:
            raise DatasetError(f"{path}: digit preprocessing needs a square model input, not {h}x{w}")
        if native == (h, w):
            x = load_image_resized(path, size=(h, w), channels=recipe.channels)
            border = torch.cat([x[:, 0], x[:, -1], x[:, :, 0], x[:, :, -1]], dim=-1)
            if border.mean() <= 0.5:
                return x, f"digit-style, taken as it is ({h}x{w}, dark background)"
        return load_image(path, size=h, channels=recipe.channels), f"digit-style: {IN_WORDS}"
    size = recipe.raw_size or (h, w)
    x = load_image_resized(path, size=size, channels=recipe.channels)
    what = "as it is" if native == size else f"resized from {native[0]}x{native[1]} to {size[0]}x{size[1]}"
    return x, what + (f", centre-cropped to {h}x{w}" if size != (h, w) else "")


def class_name(cfg, k: int) -> str:
    """Class k's name as the model recorded it from its training data, else str(k)."""
    names = getattr(cfg, "class_names", ())
    return names[k] if k < len(names) else str(k)


# ------------------------------------------------------------------------------------------------ ensembles
class EnsembleOutput(NamedTuple):
    """Mirrors `capsnet.CapsNetOutput`: the averaged lengths and their argmax."""

    capsules: None
    lengths: torch.Tensor  # mean over the members of |v_j| (or a baseline's softmax)  [B, n_classes]
    predictions: torch.Tensor  # argmax  [B]
    reconstructions: None
    coupling: None


class Ensemble(nn.Module):
    """Averages the class probabilities of `models`, which must read the same raw images (channels, size, the size
    before cropping, digit-style or not) and have the same classes. Each member gets the raw images through its own
    input recipe (its scaling may differ): `prepare_input` makes one input per member [M, B, C, H, W], which
    forward takes. `config` is the first member's (what evaluate() reads)."""

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        if not models:
            raise CheckpointError("an ensemble needs at least one model")
        first: Any = models[0].config
        for k, m in enumerate(models[1:], start=2):
            cfg: Any = m.config
            for what in ("in_channels", "n_classes", "class_names", "source_size", "digits"):
                a, b = getattr(first, what, None), getattr(cfg, what, None)
                if a != b:
                    raise CheckpointError(f"checkpoint {k} has {what} {b}, the first has {a}: not one ensemble")
            if image_hw(cfg.image_size) != image_hw(first.image_size):
                raise CheckpointError(f"checkpoint {k} takes {cfg.image_size} images, the first {first.image_size}")
        self.members = nn.ModuleList(models)
        self.config = first
        self.margin_loss = MarginLoss(first.n_classes)

    @property
    def input_recipe(self) -> InputRecipe:
        """The raw images every member reads (its shape and classes); the values are each member's own."""
        return dataclasses.replace(
            recipe_of(self.members[0]), divisor=255.0, channel_standardize=False, mean=(), std=()
        )

    def prepare_input(self, images: torch.Tensor, stats: Stats | None = None) -> torch.Tensor:
        """Raw images [B, C, H, W] -> each member's input by its own recipe, stacked [M, B, C, h, w]."""
        return torch.stack([recipe_of(m).prepare(images, stats) for m in self.members])

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None, **_) -> EnsembleOutput:
        """`images`: the members' inputs [M, B, C, H, W] (capsnet.preprocess(ensemble, images))."""
        if not images.is_floating_point() or images.dim() != 5 or images.shape[0] != len(self.members):
            raise TypeError(
                f"an Ensemble takes one prepared input per member [{len(self.members)}, B, C, H, W], got "
                f"{str(images.dtype).replace('torch.', '')} {list(images.shape)}: "
                "capsnet.preprocess(ensemble, images) makes it, capsnet.predict(ensemble, images) "
                "classifies them"
            )
        inputs = images
        lengths = torch.stack([m(x).lengths.float() for m, x in zip(self.members, inputs)]).mean(dim=0)  # [B, n]
        return EnsembleOutput(None, lengths, lengths.argmax(dim=1), None, None)

    def loss(self, out: EnsembleOutput, images: torch.Tensor, labels: torch.Tensor):
        """The margin loss (Eq. 4) of the averaged lengths."""
        margin = self.margin_loss(out.lengths, labels)
        return margin, {"margin": margin.detach(), "total": margin.detach()}
