"""The input contract (docs/inputs.md): the same raw uint8 images reach every registered model as the same tensor
through every path (the eager training batch, the graph step's batch, fit's loader, evaluate, predict from PNG
files, the ensemble, the exported ONNX graph), for every kind of input recipe; and each refusal is one line."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_api import INPUT, TINY

import capsnet
from capsnet import create_model
from capsnet.data.batching import epoch_indices
from capsnet.data.imageaug import AugmentSpec
from capsnet.data.split import Split
from capsnet.inference import Ensemble, predict
from capsnet.models.export import export_model
from capsnet.models.recipe import InputRecipe, model_input, recipe_of
from capsnet.nn.standardize import per_image_standardize
from capsnet.training import distributed as dist_utils
from capsnet.training.classification import ClassificationTask
from capsnet.training.evaluator import evaluate
from capsnet.training.graphs import StepGraph
from capsnet.training.loader import LoaderTask

N = 6
RECIPES = ["identity", "divide-256", "channel-standardize", "digits"]
ONNX_MODEL = "capsnet"  # the model each recipe's exported graph is checked on


def raw_images(seed: int = 0) -> torch.Tensor:
    """uint8 [N, 1, 28, 28]: random ink on a black border (a digit-style image predict takes as it is)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (N, 1, 28, 28), generator=g, dtype=torch.uint8)
    x[..., :3, :] = x[..., -3:, :] = x[..., :, :3] = x[..., :, -3:] = 0
    return x


def by_hand(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """The model input each recipe means, computed here without capsnet: p / 255, p / 256 or (p − mean) / std."""
    p = raw.double()
    if kind == "divide-256":
        return (p / 256).float()
    if kind == "channel-standardize":
        return ((p - p.mean()) / p.std(unbiased=False)).float()
    return (p / 255).float()


def spec_for(kind: str) -> AugmentSpec:
    return AugmentSpec(shift=0, divisor=256.0 if kind == "divide-256" else 255.0,
                       channel_standardize=kind == "channel-standardize")  # fmt: skip


def model_for(name: str, task: ClassificationTask):
    """The tiny model with the data fields the training task records (every registered model's config records
    them all)."""
    torch.manual_seed(0)
    model = create_model(name, **{**INPUT, **TINY.get(name, {})}).eval()
    fields = {f.name for f in dataclasses.fields(model.config)}
    assert set(task.model_fields()) <= fields, f"{name} does not record {set(task.model_fields()) - fields}"
    for key, value in task.model_fields().items():
        setattr(model.config, key, value)
    return model


class Seen:
    """The tensors a model's forward received (a forward pre-hook)."""

    def __init__(self, model):
        self.inputs: list[torch.Tensor] = []
        model.register_forward_pre_hook(lambda _, args: self.inputs.append(args[0].detach().clone()))


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow  # (seconds per case: every path, PNG files, an ensemble)
@pytest.mark.parametrize("kind", RECIPES)
@pytest.mark.parametrize("name", capsnet.list_models())
def test_every_path_feeds_the_model_the_same_tensor(name, kind, tmp_path):
    raw, labels = raw_images(), torch.arange(N) % 10
    want = by_hand(raw, kind)
    task = ClassificationTask(train=Split(raw, labels), test=Split(raw, labels), augment=spec_for(kind),
                              digits=kind == "digits")  # fmt: skip
    model = model_for(name, task)
    cpu = torch.device("cpu")
    # The eager training batch (in the epoch's shuffled order) and the graph step's batch (its CPU part).
    batch = next(task.batches(epoch=0, batch_size=N, seed=0, rank=0, world_size=1, device=cpu,
                              generator=torch.Generator().manual_seed(0)))  # fmt: skip
    order = epoch_indices(N, shuffle=True, seed=0, epoch=0, rank=0, world_size=1)
    same(batch.images, want[order])
    run = SimpleNamespace(task=task, device=cpu, augment_rng=torch.Generator().manual_seed(0),
                          config=SimpleNamespace(batch_size=N, seed=0))  # fmt: skip
    same(StepGraph(run, step=None, capture=False)._batch(torch.arange(N)).images, want)
    # fit's loader, from a Dataset of uint8 examples.
    fit_task = LoaderTask(_Examples(raw, labels), val_fraction=0, recipe=recipe_of(model))
    same(next(fit_task.eval_batches(fit_task.source, N, cpu, dist_utils.DistInfo())).images, want)
    # evaluate, predict from PNG files, the ensemble: what reached the model, and the same lengths.
    seen = Seen(model)
    evaluate(model, Split(raw, labels), batch_size=N)
    same(seen.inputs[-1], want)
    paths = [_png(tmp_path / f"{k}.png", raw[k]) for k in range(N)]
    results = predict(model, paths).rows(paths)
    same(seen.inputs[-1], want)
    assert {r["conversion"] for r in results} == (
        {"digit-style, taken as it is (28x28, dark background)"} if kind == "digits" else {"as it is"}
    )
    with torch.no_grad():
        lengths = model(want).lengths
        ensemble = Ensemble([model, model])
        same(ensemble(model_input(ensemble, raw)).lengths, lengths)
    assert torch.tensor([r["lengths"] for r in results]).sub(lengths).abs().max() <= 1e-5
    # The exported ONNX graph takes the raw uint8 images and applies the recipe inside: the same wrapper for every
    # model, so each recipe is checked on one model here (test_export runs every model's graph on raw images).
    if name != ONNX_MODEL:
        return
    onnxruntime = pytest.importorskip("onnxruntime")
    export_model(model, tmp_path / "model.onnx", check=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    same(torch.from_numpy(session.run(None, {"images": raw.numpy()})[0]), lengths)


class _Examples(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, k):
        return self.images[k], int(self.labels[k])


def _png(path, image: torch.Tensor):
    from PIL import Image

    Image.fromarray(image[0].numpy()).save(path)
    return path


class _OwnModel(torch.nn.Module):
    """A model of one's own: no config, its recipe as `input_recipe`, and capsnet's output fields."""

    def __init__(self, recipe: InputRecipe):
        super().__init__()
        self.input_recipe = recipe
        self.linear = torch.nn.Linear(28 * 28, 10)

    def forward(self, images, labels=None):
        lengths = torch.sigmoid(self.linear(images.flatten(1)))
        return SimpleNamespace(lengths=lengths, predictions=lengths.argmax(1), capsules=None)

    def loss(self, out, images, labels):
        return torch.nn.functional.cross_entropy(out.lengths, labels), {}


@pytest.mark.parametrize("kind", ["divide-256", "channel-standardize"])
def test_a_model_of_ones_own_is_fed_by_its_input_recipe(kind, tmp_path):
    raw, labels = raw_images(), torch.arange(N) % 10
    task = ClassificationTask(train=Split(raw, labels), test=Split(raw, labels), augment=spec_for(kind))
    model = _OwnModel(dataclasses.replace(task.recipe, channels=1, size=(28, 28), n_classes=10)).eval()
    seen = Seen(model)
    evaluate(model, Split(raw, labels), batch_size=N)
    same(seen.inputs[-1], by_hand(raw, kind))
    same(model_input(model, raw), by_hand(raw, kind))


@pytest.mark.parametrize("name", capsnet.list_models())
def test_per_image_standardization_runs_in_every_models_forward(name):
    """`standardize` (recorded from the augmentation) is honoured by every model: the first convolution, which
    every model applies to the image, then sees each image standardized, and without it does not (heinsen-capsnet:
    the BatchNorm before it, in the image's channels beside the coordinate grid)."""
    torch.manual_seed(0)
    model = create_model(name, **{**INPUT, **TINY.get(name, {})}).eval()
    first = model.convolve[0] if name == "heinsen-capsnet" else next(
        m for m in model.modules() if isinstance(m, torch.nn.Conv2d))  # fmt: skip
    seen = Seen(first)
    c = INPUT["in_channels"]
    x = torch.rand(2, c, INPUT["image_size"], INPUT["image_size"])
    with torch.no_grad():
        model(x)
        assert (seen.inputs[-1][:, :c] - per_image_standardize(x)).abs().max() > 0.1
        model.config.standardize = True
        model(x)
    same(seen.inputs[-1][:, :c], per_image_standardize(x))
