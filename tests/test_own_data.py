"""A user's own data trains out of the box: the learning rate each model takes for its size, the line that says a
run is stuck (capsnet train, capsnet.fit, capsnet explore's note), and `fit` on a Dataset as it comes (its class
names, starting afresh, and an epoch of a small set long enough to learn in)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import capsnet
from capsnet.configs.capsnet import CapsNetConfig
from capsnet.configs.deepcaps import DeepCapsConfig
from capsnet.data.batching import _epoch_seed, epoch_indices, num_batches
from capsnet.errors import ConfigError, RunFolderError
from capsnet.models.capsnet import CapsNet
from capsnet.models.deepcaps import DeepCaps
from capsnet.models.efficient_capsnet import EfficientCapsNet
from capsnet.models.registry import MODELS
from capsnet.routing.dynamic import coherent_vote_lr
from capsnet.training.checkpoint import load_state, read_summary
from capsnet.training.config import MIN_EPOCH_STEPS, min_epoch_steps, resolve_epoch_repeats
from capsnet.training.distributed import DistInfo
from capsnet.training.evaluator import evaluate_batches
from capsnet.training.stuck import memorising, memorising_line, run_stuck_line
from capsnet.training.tasks import Batch

QUIET = {"progress": False, "tensorboard": False, "device": "cpu"}


# ------------------------------------------------------------------------------------------ the learning rate
def test_the_vote_rule_is_the_papers_rate_at_the_papers_votes_per_class_and_below():
    assert coherent_vote_lr(1e-3, in_caps=1152, out_caps=10, reference=(1152, 10)) == 1e-3
    assert coherent_vote_lr(1e-3, in_caps=32, out_caps=10, reference=(1152, 10)) == 1e-3  # fewer votes: unchanged
    assert coherent_vote_lr(1e-3, in_caps=2048, out_caps=3, reference=(1152, 10)) == pytest.approx(
        1e-3 * (1152 / 10) / (2048 / 3)
    )


def test_capsnet_keeps_the_papers_rate_on_mnist_and_lowers_it_for_rgb_with_few_classes():
    assert CapsNet.lr_for(CapsNetConfig()) == 1e-3  # the paper's MNIST model: its recipe unchanged
    rgb = CapsNetConfig(in_channels=3, image_size=32, n_classes=3)
    assert rgb.n_primary == 2048
    assert CapsNet.lr_for(rgb) == pytest.approx(1.6875e-4)  # 1e-3 · (1152/10) / (2048/3)
    assert CapsNet.lr_for(CapsNetConfig(in_channels=3, image_size=32, n_classes=10)) == pytest.approx(5.625e-4)
    assert CapsNet.lr_for(CapsNetConfig(routing="self-routing")) == CapsNet.default_lr  # not dynamic routing


def test_deepcaps_keeps_its_authors_rate_at_ten_classes_and_lowers_it_at_three():
    assert DeepCaps.lr_for(DeepCapsConfig()) == 1e-3
    assert DeepCaps.lr_for(DeepCapsConfig(image_size=32, in_channels=3, n_classes=3)) == pytest.approx(3e-4)


def test_other_models_take_their_papers_rate_whatever_their_size():
    assert EfficientCapsNet.lr_for(EfficientCapsNet().config) == EfficientCapsNet.default_lr == 5e-4


def test_heinsen_capsnet_takes_its_authors_rate_with_their_gaussian_and_half_with_soft_k_means():
    from capsnet.configs.heinsen_capsnet import HeinsenCapsNetConfig
    from capsnet.models.heinsen_capsnet import HeinsenCapsNet

    assert HeinsenCapsNet.lr_for(HeinsenCapsNetConfig()) == HeinsenCapsNet.default_lr == 5e-4
    assert HeinsenCapsNet.lr_for(HeinsenCapsNetConfig(p_model="skm")) == 2.5e-4


# ------------------------------------------------------------------------------------------ stuck training
class Saturated(nn.Module):
    """A model stuck as CapsNet gets stuck: every class length near 1 whatever the image, one class predicted."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.classes = classes

    def forward(self, images, labels=None):
        b = images.shape[0]
        lengths = torch.full((b, self.classes), 0.99) + 0.001 * torch.tanh(self.scale) * torch.arange(self.classes)
        return SimpleNamespace(lengths=lengths, predictions=lengths.argmax(dim=1))

    def loss(self, out, images, labels):
        loss = (out.lengths - 0.5).square().mean()
        return loss, {}


class Balanced(torch.utils.data.Dataset):
    def __init__(self, n: int = 30, classes: int = 3):
        self.labels = torch.arange(n) % classes
        self.classes_n = classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.rand(1, 8, 8), int(self.labels[i])


class Fixed(nn.Module):
    """Returns the same class lengths [B, n_classes] for any batch."""

    def __init__(self, lengths: torch.Tensor):
        super().__init__()
        self.lengths = lengths

    def forward(self, images, labels=None):
        return SimpleNamespace(lengths=self.lengths, predictions=self.lengths.argmax(dim=1))


def test_evaluation_measures_the_mean_shortest_and_longest_class_length():
    model = Fixed(torch.tensor([[0.1, 0.9, 0.5], [0.2, 0.4, 0.3]]))
    batch = Batch(torch.zeros(2, 1, 8, 8), torch.tensor([1, 0]))  # the predictions: 1, 1

    def score(m, b):
        out = m(b.images)
        return torch.tensor(0.0), (out.predictions == b.targets).sum()

    scores = evaluate_batches(model, [batch, batch], score=score, device=torch.device("cpu"), dist=DistInfo(),
                              lengths=True)  # fmt: skip
    assert scores["shortest"] == pytest.approx((0.1 + 0.2) / 2) and scores["longest"] == pytest.approx(0.65)
    assert scores["classes"] == 3 and scores["accuracy"] == 0.5 and scores["n"] == 4
    assert model._forward_hooks == {}  # the evaluation's hook is gone


def test_fit_says_when_training_is_stuck_and_the_explorer_note_says_it_again(tmp_path, capsys):
    torch.manual_seed(0)
    capsnet.fit(Saturated(), Balanced(), epochs=1, out=tmp_path / "run", batch_size=10, lr=1e-3, **QUIET)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "training looks stuck" in line]
    assert len(lines) == 1
    assert "after epoch 1" in lines[0] and "3 classes" in lines[0] and "near 1" in lines[0] and "lr=1e-04" in lines[0]
    row = read_summary(tmp_path / "run")[-1]
    assert row["shortest_length"] == pytest.approx(0.99, abs=1e-3) and row["longest_length"] >= row["shortest_length"]
    note = run_stuck_line(tmp_path / "run", n_classes=3)
    assert note is not None and "after epoch 1" in note and "--lr 1e-04" in note
    assert run_stuck_line(tmp_path / "nowhere", n_classes=3) is None


def test_a_learning_run_says_nothing_about_being_stuck(tmp_path, capsys):
    from test_fit import Stripes, Tiny  # a module of one's own that learns its stripes

    torch.manual_seed(0)
    capsnet.fit(Tiny(), Stripes(60), epochs=2, out=tmp_path / "run", batch_size=10, **QUIET)
    assert "stuck" not in capsys.readouterr().err
    assert run_stuck_line(tmp_path / "run", n_classes=3) is None  # (no class lengths: nothing to say)


class Memoriser(Saturated):
    """A model that knows its training images' labels (it is shown them while training) and nothing else: in
    evaluation every image is class 0."""

    def forward(self, images, labels=None):
        out = super().forward(images)
        if self.training and labels is not None:
            return SimpleNamespace(lengths=out.lengths, predictions=labels)
        return SimpleNamespace(lengths=out.lengths * 0.5, predictions=torch.zeros_like(out.predictions))


@pytest.mark.parametrize(
    "train, val, says",
    [(1.0, 0.70, True), (0.95, 0.70, True), (1.0, 0.76, False), (0.94, 0.30, False), (1.0, math.nan, False)],
)
def test_memorising_is_a_fitted_training_set_and_a_held_out_accuracy_far_below(train, val, says):
    assert memorising({"epoch": 1, "train_acc": train, "val_acc": val}) is says
    assert not memorising({"epoch": 1, "train_acc": train, "test_acc": 0.0})  # no validation split: nothing said


def test_the_memorising_line_comes_once_a_run_in_the_callers_terms():
    row = {"epoch": 4, "train_acc": 1.0, "val_acc": 0.6333}
    line = memorising_line(row, [{"epoch": 3, "train_acc": 0.9, "val_acc": 0.6}], flag="--lr")
    assert line is not None and "after epoch 4" in line and "(100.0%)" in line and "(63.3%)" in line
    assert "--augment shift=2,colour" in line and "\n" not in line
    assert "__getitem__" in memorising_line(row, [], flag="lr=")  # (capsnet.fit: the Dataset augments)
    assert memorising_line(row, [{"epoch": 3, "train_acc": 1.0, "val_acc": 0.6}], flag="--lr") is None  # said


def test_fit_says_once_when_the_model_memorises_its_training_images(tmp_path, capsys):
    capsnet.fit(Memoriser(), Balanced(60), epochs=3, epoch_repeats=1, out=tmp_path / "run", batch_size=10, **QUIET)
    lines = [line for line in capsys.readouterr().err.splitlines() if "far better than the held-out" in line]
    assert len(lines) == 1 and "after epoch 1" in lines[0] and "(100.0%)" in lines[0] and "(33.3%)" in lines[0]


# ------------------------------------------------------------------------------------------ fit on a Dataset
class Named(Balanced):
    """A Dataset that names its classes as torchvision's ImageFolder does."""

    def __init__(self, n: int = 30):
        super().__init__(n)
        self.classes = ["circle", "square", "triangle"]

    def __getitem__(self, i: int):
        return torch.rand(1, 28, 28), int(self.labels[i])


def _tiny_capsnet(**kw) -> CapsNet:
    return CapsNet(conv_channels=8, primary_types=2, primary_dim=4, class_dim=4, n_classes=3, decoder=False, **kw)


def test_a_datasets_classes_name_the_models_classes(tmp_path, capsys):
    model = _tiny_capsnet()
    capsnet.fit(model, Named(12), epochs=1, out=tmp_path / "run", batch_size=6, epoch_repeats=1, **QUIET)
    assert model.config.class_names == ("circle", "square", "triangle")
    saved = json.loads((tmp_path / "run" / "best" / "config.json").read_text())
    assert saved["config"]["class_names"] == ["circle", "square", "triangle"]
    with pytest.raises(capsnet.errors.DatasetError, match="names 3 classes, the CapsNet has 4"):
        capsnet.fit(CapsNet(conv_channels=8, primary_types=2, primary_dim=4, class_dim=4, n_classes=4, decoder=False),
                    Named(12), epochs=1, out=tmp_path / "other", batch_size=6, epoch_repeats=1, **QUIET)  # fmt: skip
    assert not (tmp_path / "other").exists()


def test_overwrite_starts_a_finished_run_afresh_and_only_when_asked(tmp_path, capsys):
    run = tmp_path / "run"
    capsnet.fit(_tiny_capsnet(), Named(12), epochs=1, out=run, batch_size=6, epoch_repeats=1, **QUIET)
    first = (run / "state.pt").read_bytes()
    with pytest.raises(RunFolderError, match="already holds a run"):
        capsnet.fit(_tiny_capsnet(), Named(12), epochs=1, out=run, batch_size=6, epoch_repeats=1, **QUIET)
    assert (run / "state.pt").read_bytes() == first  # refused: nothing touched
    (run / "notes.txt").write_text("mine")  # a run's folder: all of it goes with the run
    capsnet.fit(_tiny_capsnet(), Named(12), epochs=2, out=run, batch_size=6, epoch_repeats=1, overwrite=True, **QUIET)
    assert [r["epoch"] for r in read_summary(run)] == [1.0, 2.0] and not (run / "notes.txt").exists()
    with pytest.raises(ConfigError, match="overwrite deletes the run that resume would continue"):
        capsnet.fit(
            _tiny_capsnet(),
            Named(12),
            epochs=3,
            out=run,
            batch_size=6,
            epoch_repeats=1,
            overwrite=True,
            resume=True,
            **QUIET,
        )


def test_overwrite_never_deletes_a_folder_that_is_not_a_run(tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_bytes(b"not a run")
    with pytest.raises(RunFolderError, match="is not a capsnet run folder"):
        capsnet.fit(_tiny_capsnet(), Named(12), epochs=1, out=mine, batch_size=6, overwrite=True, **QUIET)
    assert (mine / "cat.jpg").read_bytes() == b"not a run"


def test_the_note_says_default_only_of_what_the_user_left_unset(tmp_path, capsys):
    capsnet.fit(_tiny_capsnet(), Named(12), epochs=1, out=tmp_path / "a", **{**QUIET, "progress": True})
    out = capsys.readouterr().out
    assert "lr 0.001 (CapsNet's default for its configuration; set lr= to change)" in out
    assert "batch size 16 per process (the cpu default; set batch_size= to change)" in out
    # 11 training examples (1 held out) at 16: 581 passes are 6,391 examples, CapsNet's 400 steps (580: 399)
    assert "epoch: 581 passes over the training images, 400 steps (at least 400 on data of one's own; set " in out
    capsnet.fit(_tiny_capsnet(), Named(12), epochs=1, out=tmp_path / "b", lr=3e-4, batch_size=6, epoch_repeats=1,
                **{**QUIET, "progress": True})  # fmt: skip
    out = capsys.readouterr().out
    assert "default" not in out


# ------------------------------------------------------------------------------------------ a small set's epoch
@pytest.mark.parametrize("repeats", [1, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_an_epoch_of_repeats_visits_every_example_as_often_and_one_pass_is_the_plain_permutation(repeats, world_size):
    n, seed = 10, 4
    shards = [epoch_indices(n, shuffle=True, seed=seed, epoch=2, rank=r, world_size=world_size, repeats=repeats)
              for r in range(world_size)]  # fmt: skip
    seen = torch.cat(shards)
    assert len(seen) == n * repeats and torch.bincount(seen, minlength=n).tolist() == [repeats] * n
    if repeats == 1 and world_size == 1:  # the order every run made before repeats existed
        g = torch.Generator().manual_seed(_epoch_seed(seed, 2))
        assert torch.equal(seen, torch.randperm(n, generator=g))
    assert num_batches(n * repeats, batch_size=4, world_size=world_size) == -(-len(shards[0]) // 4)


def test_unset_repeats_lengthen_only_a_small_epoch_of_ones_own_data():
    def steps(n: int, batch_size: int, world_size: int = 1):
        return lambda r: num_batches(n * r, batch_size=batch_size, world_size=world_size)

    assert resolve_epoch_repeats(None, steps=steps(270, 16), own_data=True) == 12  # 3,240 images: 203 steps
    # 91 examples on 2 ranks at 8: 6 steps a pass, but 34 passes are 194 steps; 35 are 200
    assert resolve_epoch_repeats(None, steps=steps(91, 8, 2), own_data=True) == 35
    assert steps(91, 8, 2)(34) == 194 and steps(91, 8, 2)(35) == 200
    assert resolve_epoch_repeats(None, steps=steps(3200, 16), own_data=True) == 1
    assert resolve_epoch_repeats(None, steps=steps(5400, 120), own_data=False) == 1  # a recorded recipe's set
    assert resolve_epoch_repeats(2, steps=steps(270, 16), own_data=True) == 2  # given: as given
    assert resolve_epoch_repeats(2, steps=steps(60000, 16), own_data=False) == 2
    # a model's own fewest steps (its own_data_epoch_steps): 24 passes of 17 steps make 405
    assert resolve_epoch_repeats(None, steps=steps(270, 16), own_data=True, min_steps=400) == 24


def test_a_model_may_set_its_own_fewest_steps_an_epoch():
    class Own(torch.nn.Module):
        own_data_epoch_steps = 50

    assert min_epoch_steps(Own) == 50
    assert min_epoch_steps(torch.nn.Module) == MIN_EPOCH_STEPS  # a module of one's own: the loop's
    for bad in (0, -5, 2.5, True, "400"):
        Own.own_data_epoch_steps = bad
        with pytest.raises(ConfigError, match=r"Own.own_data_epoch_steps is .*: need a whole number, 1 or more"):
            min_epoch_steps(Own)
    for name, cls in MODELS.items():  # every registered model's is a whole number of steps at least the loop's
        steps = min_epoch_steps(cls)
        assert isinstance(steps, int) and steps >= MIN_EPOCH_STEPS, name


def test_a_model_may_set_its_own_options_for_ones_own_data():
    from capsnet.models.baseline import BaselineCNN
    from capsnet.models.em_capsnet import SMALL, EMCapsNet
    from capsnet.models.heinsen_capsnet import HeinsenCapsNet
    from capsnet.training.config import own_data_options

    class Own(CapsNet):
        own_data_options: ClassVar[dict[str, Any]] = {"routing_iterations": 2}

    assert own_data_options(Own) == {"routing_iterations": 2} and own_data_options(CapsNet) == {}
    assert own_data_options(torch.nn.Module) == {}  # a module of one's own sets none
    for bad in ({"no_such_field": 1}, [("routing_iterations", 2)]):
        Own.own_data_options = bad  # type: ignore[assignment]
        with pytest.raises(ConfigError, match=r"Own.own_data_options is .*: need a dict of fields of CapsNetConfig"):
            own_data_options(Own)
    assert own_data_options(HeinsenCapsNet) == {"p_model": "skm"}  # (docs/training.md says why)
    assert own_data_options(BaselineCNN) == {"pool": True}
    assert own_data_options(EMCapsNet) == SMALL  # the paper's small network
    for name, cls in MODELS.items():  # every registered model's are fields of its config
        assert isinstance(own_data_options(cls), dict), name


def test_own_data_options_fill_only_what_the_caller_left_unset_and_only_on_ones_own_data(tmp_path, capsys):
    from capsnet.cli import main
    from capsnet.data.datasets import load_dataset
    from capsnet.data.synthetic import make_case, write_folder
    from capsnet.training.api import train
    from capsnet.training.config import TrainConfig

    folder = write_folder(make_case("two-shapes", n_per_class=6, n_test_per_class=2, seed=0), tmp_path / "shapes")
    small = {"conv_channels": 4, "n_parts": 2, "routing_iterations": 1}
    runs = {"unset": small, "given": {**small, "p_model": "gaussian"}}
    for name, options in runs.items():
        config = TrainConfig(dataset=str(folder), model="heinsen-capsnet", epochs=1, epoch_repeats=1, **QUIET)
        train(dataclasses.replace(config, out=str(tmp_path / name)), options)
    out = capsys.readouterr().out
    saved = {name: json.loads((tmp_path / name / "config.json").read_text())["model"] for name in runs}
    assert saved["unset"]["p_model"] == "skm" and saved["given"]["p_model"] == "gaussian"
    assert saved["unset"]["conv_channels"] == saved["given"]["conv_channels"] == 4  # what was set is kept
    assert out.count("p_model skm (heinsen-capsnet's setting on data of one's own; set --p-model to change)") == 1
    assert out.count("lr 0.00025 (heinsen-capsnet's default for its configuration") == 1  # (skm's rate: lr_for)
    # a data set with a recorded recipe keeps the paper's defaults; the command line sets as the flags say
    flags = ["--model", "heinsen-capsnet", "--conv-channels", "4", "--n-parts", "2", "--routing-iterations", "1",
             "--epochs", "1", "--no-progress", "--no-tensorboard", "--device", "cpu"]  # fmt: skip
    sample = ["--dataset", "mnist-sample", "--train-subset", "8", "--test-subset", "4", "--val-fraction", "0.25"]
    assert main(["train", *flags, *sample, "--out", str(tmp_path / "sample")]) == 0
    own = ["--dataset", str(folder), "--epoch-repeats", "1"]
    assert main(["train", *flags, *own, "--out", str(tmp_path / "cli")]) == 0
    assert "p_model skm (heinsen-capsnet's setting on data of one's own" in capsys.readouterr().out
    for name, p_model in (("sample", "gaussian"), ("cli", "skm")):
        assert json.loads((tmp_path / name / "config.json").read_text())["model"]["p_model"] == p_model, name
    # a switch: the baseline pools on one's own data unless --no-pool is given
    base = ["--model", "baseline", "--channels", "4", "4", "--hidden", "8", *flags[8:], *own]
    assert main(["train", *base, "--out", str(tmp_path / "pooled")]) == 0
    assert main(["train", *base, "--no-pool", "--out", str(tmp_path / "unpooled")]) == 0
    assert capsys.readouterr().out.count("pool True (baseline's setting on data of one's own; set --no-pool to") == 1
    for name, pool in (("pooled", True), ("unpooled", False)):
        assert json.loads((tmp_path / name / "config.json").read_text())["model"]["pool"] is pool, name
    # fit trains the model it is given, and says how to build one with the own-data options
    model = capsnet.create_model("heinsen-capsnet", in_channels=3, image_size=32, n_classes=2, **small)
    split = load_dataset(str(folder)).train
    assert split is not None
    images = torch.utils.data.TensorDataset(split.images, split.labels)
    capsnet.fit(model, images, epochs=1, epoch_repeats=1, out=tmp_path / "fit", **QUIET)
    assert "heinsen-capsnet learns data of one's own with p_model='skm'" in capsys.readouterr().err
    assert model.config.p_model == "gaussian"


@pytest.mark.slow
def test_a_folder_run_records_its_repeats_says_so_once_and_resumes_with_them(tmp_path, capsys):
    from helpers import small_config

    from capsnet.cli import main
    from capsnet.data.synthetic import make_case, write_folder
    from capsnet.training.api import train
    from capsnet.training.config import TrainConfig

    folder = write_folder(make_case("two-shapes", n_per_class=20, n_test_per_class=4, seed=0), tmp_path / "shapes")
    run = tmp_path / "run"
    config = TrainConfig(dataset=str(folder), epochs=1, batch_size=12, out=str(run), **QUIET)
    train(config, small_config(kernel_size=5))
    out = capsys.readouterr().out
    # 36 training images (4 held out) at 12 are 3 steps a pass: 134 passes make CapsNet's 400 steps (402)
    assert CapsNet.own_data_epoch_steps == 400
    assert out.count("epoch: 134 passes over the training images, 402 steps (at least 400") == 1
    assert "--epoch-repeats" in out
    # the shapes' colours are random: the colour augmentation joins the shifts, and one line says why
    assert out.count("augment: shift=2,colour, since the training images' mean colours do not tell") == 1
    meta = json.loads((run / "config.json").read_text())
    assert meta["train"]["epoch_repeats"] == 134 and load_state(run)["step"] == 402
    assert meta["train"]["augment"] == "auto" and meta["augment"] == "shift=2,colour"
    assert main(["train", "--out", str(run), "--resume", "--epochs", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "passes over" not in out and "augment:" not in out  # (the run's own, recorded: nothing chosen)
    assert load_state(run)["step"] == 804


def test_the_sample_keeps_one_pass_and_an_iterable_cannot_repeat(tmp_path, capsys):
    from helpers import small_config

    from capsnet.training.api import train
    from capsnet.training.config import TrainConfig

    config = TrainConfig(dataset="mnist-sample", epochs=1, train_subset=64, batch_size=32, out=str(tmp_path / "run"))
    train(dataclasses.replace(config, **QUIET), small_config(kernel_size=5))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["epoch_repeats"] == 1
    assert "passes over" not in capsys.readouterr().out
    batches = [(torch.rand(6, 1, 28, 28), torch.arange(6) % 3)]
    with pytest.raises(ConfigError, match="epoch_repeats 2: this training data cannot repeat within an epoch"):
        capsnet.fit(_tiny_capsnet(), batches, epochs=1, epoch_repeats=2, out=tmp_path / "it", **QUIET)
    assert not (tmp_path / "it").exists()


# ------------------------------------------------------------------------------------------ colour augmentation
def _split(colours, labels, size=4):
    """A Split of plain images, image i all colours[i] (RGB 0-255)."""
    from capsnet.data.split import Split

    images = torch.tensor(colours, dtype=torch.uint8)[:, :, None, None].expand(-1, -1, size, size).contiguous()
    return Split(images, torch.tensor(labels))


def test_the_colour_check_is_a_held_out_nearest_centroid_on_mean_colours():
    from capsnet.data.colour import SIGMAS, colour_check

    # red images are class 0, blue ones class 1: every held-out image is right
    found = colour_check(_split([[200, 0, 0], [0, 0, 200]] * 10, [0, 1] * 10))
    assert (found.accuracy, found.chance, found.n) == (1.0, 0.5, 20) and not found.colour_free
    assert found.margin == pytest.approx(SIGMAS * (0.25 / 20) ** 0.5)
    # class 0 alternates red, blue and class 1 blue, red: fitted on the even ones of each class, the centroids are
    # red (0) and blue (1), and every odd one is taken for the other class; the same the other way round
    red, blue = [200, 0, 0], [0, 0, 200]
    found = colour_check(_split([red, blue, blue, red] * 5, [0, 0, 1, 1] * 5))
    assert found.accuracy == 0.0 and found.colour_free
    assert "do not tell their classes apart" in found.line() and "0.0% held out, chance 50.0%" in found.line()
    assert colour_check(_split([[9, 9, 9]] * 20, [0] * 20)) is None  # one class
    assert colour_check(_split([[9, 9, 9], [1, 2, 3]] * 9, [0, 1] * 9)) is None  # too few images
    grey = _split([[9, 9, 9]] * 20, [0, 1] * 10)
    assert colour_check(dataclasses.replace(grey, images=grey.images[:, :1])) is None  # not RGB


@pytest.mark.parametrize("case, colour", [("shapes", True), ("textures", True), ("shapes-20", False)])
def test_own_folders_get_colour_augmentation_when_colour_does_not_make_the_class(case, colour, tmp_path):
    from capsnet.data.synthetic import CASES, make_case, write_folder
    from capsnet.training.classification import ClassificationTask
    from capsnet.training.config import TrainConfig

    n = CASES[case].n_train
    folder = write_folder(make_case(case, n_per_class=n, n_test_per_class=2, seed=0), tmp_path / case)
    task = ClassificationTask.from_config(TrainConfig(dataset=str(folder), out=str(tmp_path / "run")))
    assert task.spec.colour is colour and str(task.spec) == ("shift=2,colour" if colour else "shift=2")
    assert bool(task.notes) is colour  # the line says why, only when the colour joins
    # given augmentation stays as given
    given = TrainConfig(dataset=str(folder), augment="shift=1", out=str(tmp_path / "run"))
    assert str(ClassificationTask.from_config(given).spec) == "shift=1"


def test_colour_joins_only_the_default_of_a_format_of_ones_own():
    from capsnet.data.imageaug import resolve_augment

    free = SimpleNamespace(colour_free=True)
    assert str(resolve_augment("auto", "folder", colours=free)) == "shift=2,colour"
    assert str(resolve_augment("auto", "npz", shift=3, colours=free)) == "shift=3,colour"
    assert str(resolve_augment("auto", "folder", colours=SimpleNamespace(colour_free=False))) == "shift=2"
    assert not resolve_augment("auto", "cifar10", colours=free).colour  # a recorded recipe
    recipes = {"folder": {"augment": "crop=24"}}
    assert str(resolve_augment("auto", "folder", recipes=recipes, colours=free)) == "crop=24x24"  # the model's
    assert str(resolve_augment("flip", "folder", colours=free)) == "flip"


def test_data_info_says_whether_colour_joins_a_folders_augmentation(tmp_path, capsys):
    from capsnet.cli import main
    from capsnet.data.synthetic import make_case, write_folder

    folder = write_folder(make_case("shapes", n_per_class=20, n_test_per_class=2, seed=0), tmp_path / "shapes")
    assert main(["data", "info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "augmentation (default): shift=2,colour (" in out
    assert "colour: the training images' mean colours do not tell their classes apart" in out
