"""capsnet.fit: capsnet's training loop on a Dataset or DataLoader of one's own and on a module of one's own that
follows the protocol (forward(images, labels=None) -> .predictions; loss(out, images, labels) -> (loss, parts)):
the run folder, validation, resume (bit for bit mid-epoch on a Dataset, at the epoch boundary on a DataLoader),
torchrun, and bad input as one clear error."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import capsnet
from capsnet.data import Split
from capsnet.errors import CapsNetError, CheckpointError, ConfigError, DatasetError
from capsnet.training.checkpoint import load_state, read_summary
from capsnet.training.evaluator import evaluate
from capsnet.training.loader import LoaderTask, SeededSampler

QUIET = {"progress": False, "tensorboard": False, "device": "cpu"}


class Stripes(torch.utils.data.Dataset):
    """A data set written the way a user writes one: class k is a bright band in rows 4k ... 4k+3 of a 12×12
    image, on noise. `noisy`: each read adds fresh noise drawn from torch's global random state."""

    def __init__(self, n: int, *, seed: int = 0, classes: int = 3, uint8: bool = False, noisy: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, classes, (n,), generator=g)
        images = torch.rand(n, 1, 12, 12, generator=g) * 0.4
        for i, k in enumerate(self.targets.tolist()):
            images[i, 0, 4 * k : 4 * k + 4] += 0.6
        self.images = (images * 255).to(torch.uint8) if uint8 else images
        self.noisy = noisy

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        image = self.images[i]
        if self.noisy:
            image = image + 0.05 * torch.rand(image.shape)
        return image, int(self.targets[i])


class Tiny(nn.Module):
    """A module of one's own following the protocol, with dropout (so that the random state matters)."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(144, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, classes))

    def forward(self, images, labels=None):
        logits = self.net(images)
        return SimpleNamespace(logits=logits, predictions=logits.argmax(dim=1))

    def loss(self, out, images, labels):
        loss = nn.functional.cross_entropy(out.logits, labels)
        return loss, {"cross_entropy": loss.detach()}


def _tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("seconds", "images_per_s")} for r in read_summary(run)]


# ------------------------------------------------------------------------------------------------ the run
def test_fit_a_dataset_of_ones_own_writes_the_run_folder(tmp_path, capsys):
    model = _tiny()
    result = capsnet.fit(model, Stripes(200), test_data=Stripes(60, seed=1), epochs=2, out=tmp_path / "run",
                         batch_size=16, lr=1e-2, **QUIET)  # fmt: skip
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {"config.json", "summary.csv", "best", "last", "state.pt", "test.json"}
    meta = json.loads((run / "config.json").read_text())
    assert meta["task"] == "loader" and meta["model"] is None and meta["train"]["model"] == "test_fit.Tiny"
    # A seeded, stratified tenth of the Dataset held out for validation (20 of 200), as capsnet train does.
    assert meta["validation"] == {"source": "held out of the training split", "fraction": 0.1, "seed": 0, "n": 20}
    assert meta["data"]["train"] == {"type": "Stripes", "kind": "dataset", "n": 180}
    rows = read_summary(run)
    assert [r["epoch"] for r in rows] == [1, 2] and all(0 <= r["val_acc"] <= 1 and math.isnan(r["test_acc"])
                                                         for r in rows)  # fmt: skip
    assert result.best["metric"] == "val_loss" and rows[-1]["train_acc"] > 0.9  # the bands are easy (monitor: val_loss)
    # last/ holds the weights the model ends with (trained in place); best/ loads back into an instance.
    assert _same_weights(load_file(str(run / "last" / "model.safetensors")), model.state_dict())
    again = Tiny()
    again.load_state_dict(load_file(str(run / "best" / "model.safetensors")))
    saved = json.loads((run / "best" / "config.json").read_text())
    assert saved["module"] == "test_fit.Tiny" and saved["checkpoint"]["view"] == "best"
    report = json.loads((run / "test.json").read_text())
    test = Stripes(60, seed=1)
    scored = evaluate(again, Split(test.images, test.targets))  # evaluate() takes a module without a capsnet config
    assert report["best"]["accuracy"] == pytest.approx(scored["accuracy"]) and report["best"]["n"] == 60
    assert report["best"]["loss"] == pytest.approx(scored["loss"], rel=1e-5)
    assert "best/ is chosen" not in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="a module of one's own"):
        capsnet.load_pretrained(run / "best")


def test_fit_a_dataloader_without_validation_says_what_best_is_chosen_on(tmp_path, capsys):
    loader = torch.utils.data.DataLoader(Stripes(96), batch_size=16, shuffle=True)
    test = torch.utils.data.DataLoader(Stripes(40, seed=1), batch_size=32)
    result = capsnet.fit(_tiny(), loader, test_data=test, epochs=2, out=tmp_path / "a", lr=1e-2, **QUIET)
    err = capsys.readouterr()
    assert err.err.count("best/ is chosen on test_data") == 1 and "batch size" not in err.out  # (the loader's own)
    assert result.best["metric"] == "test_loss" and "maximum over epochs" in result.test["note"]
    assert result.test["last"]["n"] == 40
    # With neither validation nor test data: best/ is the epoch of the lowest training loss, and no test.json.
    result = capsnet.fit(_tiny(), loader, epochs=2, out=tmp_path / "b", lr=1e-2, **QUIET)
    assert "lowest training loss" in capsys.readouterr().err
    rows = read_summary(tmp_path / "b")
    assert result.best["metric"] == "train_loss" and result.test is None and not (tmp_path / "b" / "test.json").exists()
    assert result.best["epoch"] == min(rows, key=lambda r: r["train_loss"])["epoch"]


def test_fit_a_capsnet_model_on_uint8_images(tmp_path):
    model = capsnet.create_model("capsnet", in_channels=1, image_size=12, n_classes=3, conv_channels=8,
                                 primary_types=2, primary_dim=4, class_dim=4, kernel_size=3,
                                 decoder_hidden=(16, 16))  # fmt: skip
    data = Stripes(64, uint8=True)
    val = Stripes(30, seed=2, uint8=True)
    result = capsnet.fit(model, data, val_data=val, test_data=Stripes(30, seed=1, uint8=True), epochs=1,
                         epoch_repeats=1, out=tmp_path / "run", batch_size=16, **QUIET)  # fmt: skip
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["validation"] == {"source": "given", "n": 30} and meta["model"]["n_classes"] == 3
    assert meta["train"]["model"] == "capsnet" and meta["train"]["lr"] == capsnet.CapsNet.default_lr
    best = capsnet.load_pretrained(tmp_path / "run" / "best")  # a capsnet model keeps its save_pretrained folders
    scored = evaluate(best, Split(val.images, val.targets))  # (the uint8 images ÷ 255, as fit fed them)
    assert scored["loss"] == pytest.approx(result.best["value"], rel=1e-5) and result.best["metric"] == "val_loss"


def test_evaluate_a_module_of_ones_own_counts_predictions_outside_the_labels_as_wrong():
    class Constant(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k, self.w = k, nn.Parameter(torch.zeros(()))

        def forward(self, images, labels=None):
            return SimpleNamespace(predictions=torch.full((len(images),), self.k))

        def loss(self, out, images, labels):
            return self.w * 0, {}

    split = Split(torch.zeros(6, 1, 4, 4, dtype=torch.uint8), torch.tensor([0, 1, 1, 2, 2, 2]))
    three = evaluate(Constant(2), split)
    assert three["accuracy"] == pytest.approx(0.5) and three["confusion"] == [[0, 0, 1], [0, 0, 2], [0, 0, 3]]
    outside = evaluate(Constant(7), split)
    assert outside["accuracy"] == 0 and outside["n"] == 6 and outside["confusion"] == [[0] * 3] * 3
    assert outside["per_class"] == [0.0, 0.0, 0.0]


class Centred(Tiny):
    """A module of one's own with the optional data-dependent initialisation hook."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.calls: list[torch.Tensor] = []

    def init_from_data(self, images):
        self.calls.append(images.clone())
        self.seen += len(images)


def test_init_from_data_sees_the_first_batch_once_and_never_on_resume(tmp_path):
    model, data = Centred(), Stripes(100)
    kw = dict(epochs=1, epoch_repeats=2, out=tmp_path / "run", batch_size=16, precision="bf16", **QUIET)
    capsnet.fit(model, data, **kw)
    (first,) = model.calls  # rank 0's first batch of epoch 0 (of the 90 examples left after the hold-out)
    kept = LoaderTask(data).source.data  # (the same seeded hold-out)
    order = list(SeededSampler(len(kept), seed=0, repeats=2))[:16]
    assert torch.equal(first, torch.stack([kept[i][0] for i in order]))
    again = Centred()
    capsnet.fit(again, data, resume=True, **{**kw, "epochs": 2})
    assert again.calls == [] and int(again.seen) == 16  # restored from state.pt, not initialised again


# ------------------------------------------------------------------------------------------------ resume
def test_a_resumed_fit_on_a_dataset_equals_the_uninterrupted_run_bit_for_bit(tmp_path, capsys):
    """Stopped mid-epoch and resumed, the run skips the batches done (SeededSampler) without drawing random
    numbers, and ends with the uninterrupted run's weights, summary and test figures (CPU: deterministic), with
    dropout and a Dataset that adds fresh noise on every read (torch's global random state, restored)."""
    kw = dict(test_data=Stripes(40, seed=1), epochs=2, epoch_repeats=2, batch_size=16, lr=1e-2, **QUIET)
    capsnet.fit(_tiny(), Stripes(100, noisy=True), out=tmp_path / "whole", **kw)
    stopped = capsnet.fit(_tiny(), Stripes(100, noisy=True), out=tmp_path / "parts", on_step=lambda s: s == 8, **kw)
    assert stopped.interrupted and stopped.epochs_done == 0
    state = load_state(tmp_path / "parts")
    # 90 examples at 16 are 6 steps a pass and 12 an epoch of two passes: stopped in the first epoch's second pass
    assert (state["epoch"], state["batch_in_epoch"], state["step"]) == (0, 8, 8)
    with pytest.raises(ConfigError, match="already holds a run; pass resume=True"):
        capsnet.fit(_tiny(), Stripes(100, noisy=True), out=tmp_path / "parts", **kw)
    resumed = capsnet.fit(_tiny(seed=5), Stripes(100, noisy=True), out=tmp_path / "parts", resume=True, **kw)
    assert resumed.epochs_done == 2 and not resumed.interrupted
    for view in ("last", "best"):
        a, b = (load_file(str(tmp_path / run / view / "model.safetensors")) for run in ("whole", "parts"))
        assert _same_weights(a, b), view
    assert _rows(tmp_path / "whole") == _rows(tmp_path / "parts")
    assert json.loads((tmp_path / "whole" / "test.json").read_text()) == resumed.test
    # A resumed run keeps its settings: another batch size (or another model) is refused, naming both values.
    with pytest.raises(ConfigError, match=r"batch_size=8 conflicts with the run's recorded batch_size=16"):
        capsnet.fit(_tiny(), Stripes(100), out=tmp_path / "parts", resume=True, **{**kw, "batch_size": 8})

    class Other(Tiny):
        pass

    with pytest.raises(
        ConfigError, match=r"model='test_fit.*Other' conflicts with the run's recorded model='test_fit.Tiny"
    ):
        capsnet.fit(Other(), Stripes(100), out=tmp_path / "parts", resume=True, **{**kw, "epochs": 3})
    with pytest.raises(ConfigError, match=r"trained with 90 train examples, this train data has 200"):
        capsnet.fit(_tiny(), Stripes(200), out=tmp_path / "parts", resume=True, **{**kw, "val_data": Stripes(10)})


def test_the_seeded_sampler_shards_like_a_distributed_sampler_and_skips_without_drawing():
    full = [list(SeededSampler(10, seed=3, rank=r, world_size=3)) for r in range(3)]
    assert all(len(f) == 4 for f in full) and {i for f in full for i in f} == set(range(10))  # wraps: 12 in all
    state = torch.get_rng_state()
    tail = SeededSampler(10, seed=3, rank=1, world_size=3, start=2)
    assert list(tail) == full[1][2:] and len(tail) == 2 and torch.equal(torch.get_rng_state(), state)
    other = SeededSampler(10, seed=3, rank=1, world_size=3)
    other.set_epoch(1)
    assert list(other) != full[1]  # a new permutation each epoch


def test_a_resumed_fit_on_a_dataloader_continues_at_the_epoch_boundary(tmp_path, capsys):
    """An iterable's order cannot be replayed: a stop mid-epoch keeps the last finished epoch's checkpoint, and the
    resumed run redoes that epoch from its start, ending as the uninterrupted run (the DataLoader's shuffle comes
    from torch's global random state, restored from that checkpoint)."""

    def loader():
        return torch.utils.data.DataLoader(Stripes(80), batch_size=16, shuffle=True)

    kw = dict(test_data=[(Stripes(20, seed=1).images, Stripes(20, seed=1).targets)], epochs=3, lr=1e-2, **QUIET)
    capsnet.fit(_tiny(), loader(), out=tmp_path / "whole", **kw)
    capsys.readouterr()
    stopped = capsnet.fit(_tiny(), loader(), out=tmp_path / "parts", on_step=lambda s: s == 2, **kw)
    assert stopped.interrupted and not (tmp_path / "parts" / "state.pt").exists()  # stopped in epoch 1: nothing kept
    assert "before any checkpoint" in capsys.readouterr().err
    capsnet.fit(_tiny(), loader(), out=tmp_path / "parts", on_step=lambda s: s == 7, **kw)  # in epoch 2, step 2 of 5
    assert "the checkpoint of epoch 1 is kept and a resumed run starts epoch 2 again" in capsys.readouterr().err
    state = load_state(tmp_path / "parts")
    assert (state["epoch"], state["batch_in_epoch"], state["step"]) == (1, 0, 5)
    resumed = capsnet.fit(_tiny(), loader(), out=tmp_path / "parts", resume=True, **kw)
    assert resumed.epochs_done == 3
    a, b = (load_file(str(tmp_path / run / "last" / "model.safetensors")) for run in ("whole", "parts"))
    assert _same_weights(a, b)
    assert _rows(tmp_path / "whole") == _rows(tmp_path / "parts")


# ------------------------------------------------------------------------------------------------ bad input
class Flat(torch.utils.data.Dataset):
    """Images without their channel axis: [H, W]."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(12, 12), i % 3


class NoLoss(nn.Module):
    def forward(self, images, labels=None):
        return SimpleNamespace(predictions=images.flatten(1).sum(1).long())


class NoPredictions(Tiny):
    def forward(self, images, labels=None):
        return self.net(images)


class Pixels255(Stripes):
    """Stripes as float pixels 0-255: `images.float()` of uint8 data, outside the [0, 1] contract."""

    def __init__(self, n: int):
        super().__init__(n, uint8=True)
        self.images = self.images.float()
        self.images[0, 0, 0, 0] = 0.0


class Items(torch.utils.data.IterableDataset):
    """Yields single examples, not batches."""

    def __iter__(self):
        return iter(Stripes(8)[i] for i in range(8))


@pytest.mark.parametrize("digits", [None, True, False])
def test_fit_keeps_what_the_model_records_of_digits_unless_told(tmp_path, digits):
    # a shipped digit model (digits: true) fine-tuned without a word stays a digit model; False or True is recorded
    model = capsnet.create_model("capsnet", in_channels=1, image_size=12, n_classes=3, conv_channels=8,
                                 primary_types=2, primary_dim=4, class_dim=4, kernel_size=3,
                                 decoder_hidden=(16, 16), digits=True)  # fmt: skip
    capsnet.fit(model, Stripes(16), epochs=1, out=tmp_path / "run", batch_size=8, val_fraction=0, digits=digits,
                **QUIET)  # fmt: skip
    want = True if digits is None else digits
    assert model.config.digits is want
    assert json.loads((tmp_path / "run" / "best" / "config.json").read_text())["config"]["digits"] is want


def test_fit_without_progress_shows_warnings_only(tmp_path, capsys):
    # the run's lines go through the capsnet logger: progress=False keeps its information lines quiet
    capsnet.fit(Tiny(), Stripes(16), epochs=1, out=tmp_path / "quiet", batch_size=8, **QUIET)
    assert capsys.readouterr().out == ""
    capsnet.fit(Tiny(), Stripes(16), epochs=1, out=tmp_path / "shown", batch_size=8, **{**QUIET, "progress": True})
    out = capsys.readouterr().out
    assert "epoch 1/1  train loss" in out and "batch size 8" not in out  # (a given batch size is not announced)


def _capsnet_1x28():
    return capsnet.create_model("capsnet", conv_channels=8, primary_types=2, primary_dim=4, class_dim=4,
                                decoder_hidden=(16, 16))  # fmt: skip


def _batches(images, labels):
    return lambda: [(images, labels)]


# case: (the model, the data, the error, what its one line says)
BAD = {
    "an image without its channel axis": (
        Tiny, Flat, DatasetError, r"train_data\[0\]: the image is shape \[12, 12\]; expected a tensor \[C, H, W\]"),
    "a float label": (
        Tiny, _batches(torch.rand(4, 1, 12, 12), torch.rand(4)), DatasetError,
        r"the labels are \[4\] torch.float32; expected class indices"),
    "a model without loss": (NoLoss, lambda: Stripes(8), ConfigError, r"NoLoss has no loss\(out, images, labels\)"),
    "an output without predictions": (NoPredictions, lambda: Stripes(8), ConfigError, r"output has .predictions none"),
    "images the model cannot take": (
        Tiny, _batches(torch.rand(4, 1, 10, 10), torch.zeros(4).long()), ConfigError,
        r"Tiny\(images, labels\) failed on a first batch \(images \[4, 1, 10, 10\] float32.*RuntimeError: mat1"),
    "a capsnet model on other images": (
        _capsnet_1x28, lambda: Stripes(8), DatasetError, r"images are 1x12x12, the CapsNet expects 1x28x28"),
    "examples where batches go": (
        Tiny, lambda: torch.utils.data.DataLoader(Items(), batch_size=None), DatasetError,
        r"the images are shape \[1, 12, 12\]; expected a batch \[B, C, H, W\] \(a Dataset of single examples"),
    "a one-shot iterator": (
        Tiny, lambda: iter(_batches(torch.rand(4, 1, 12, 12), torch.zeros(4).long())()), DatasetError,
        r"train_data is an iterator, which can be read only once"),
    "not data at all": (Tiny, lambda: 42, DatasetError, r"train_data: a int is neither a Dataset"),
    "float pixels in 0-255": (
        Tiny, lambda: Pixels255(8), DatasetError,
        r"train_data\[0\]: float pixels span \[0, \d+\]; float images must be in \[0, 1\] \(pixels / 255\)"),
    "a batch of float pixels in 0-255": (
        Tiny, _batches(torch.full((4, 1, 12, 12), 255.0), torch.zeros(4).long()), DatasetError,
        r"train_data batch 0: float pixels span \[255, 255\]; float images must be in \[0, 1\]"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_error_and_writes_nothing(case, tmp_path):
    make_model, make_data, error, message = BAD[case]
    with pytest.raises(error, match=message) as caught:
        capsnet.fit(make_model(), make_data(), epochs=1, out=tmp_path / "run", batch_size=4, **QUIET)
    assert isinstance(caught.value, CapsNetError) and "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_bad_settings_are_one_clear_error(tmp_path):
    for kw, message in [({"epochs": 0}, "epochs must be >= 1"), ({"val_fraction": 1.0}, "val_fraction"),
                        ({"workers": -1}, "workers must be >= 0"), ({"precision": "fp8"}, "precision")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            capsnet.fit(Tiny(), Stripes(8), out=tmp_path / "run", **{"epochs": 1, **kw})
    with pytest.raises(ConfigError, match=r"model must be an nn\.Module"):
        capsnet.fit(lambda x: x, Stripes(8), epochs=1, out=tmp_path / "run")


# ------------------------------------------------------------------------------------------------ torchrun
FIT_SCRIPT = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[2])
import capsnet
from test_fit import Stripes, Tiny

out = sys.argv[1]
torch.manual_seed(0)
model = Tiny()
data = Stripes(101)  # odd: the ranks' shares differ unless the sampler pads
result = capsnet.fit(model, data, test_data=Stripes(41, seed=1), epochs=2, epoch_repeats=1, out=out, batch_size=8,
                     lr=1e-2, progress=True, tensorboard=False, device="cpu")
rank = int(os.environ["RANK"])
torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.pt")
"""


def _torchrun(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_fit_under_torchrun_two_cpu_processes(tmp_path):
    """2 gloo processes: a Dataset (of odd length) is sharded by the seeded sampler; both ranks end with the same
    weights (DDP), only rank 0 writes, and the test data is scored once in all. (A DataLoader sharded by its own
    DistributedSampler: test_fit_trains_a_distributed_samplers_dataloader_under_ddp, in-process.)"""
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    out = tmp_path / "run"
    r = _torchrun(script, str(out), str(Path(__file__).parent))
    assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-6000:]}"
    assert r.stdout.count("epoch 2/2") == 1  # rank 0 alone logs
    a, b = (torch.load(out / f"rank{k}.pt", weights_only=True) for k in (0, 1))
    assert _same_weights(a, b)
    assert _same_weights(a, load_file(str(out / "last" / "model.safetensors")))
    report = json.loads((out / "test.json").read_text())
    assert report["last"]["n"] == 41  # each test example once over both ranks
    state = load_state(out)
    assert state["step"] == 2 * 6 and [r["epoch"] for r in read_summary(out)] == [1, 2]  # 91 of 101 / 2 ranks / 8


def test_fit_trains_a_distributed_samplers_dataloader_under_ddp(tmp_path, one_rank_ddp):
    """A DataLoader sharded by its own DistributedSampler, under DDP (a one-rank gloo group in this process): the
    sampler is told each epoch, the test data is scored once, and the run keeps its steps."""
    torch.manual_seed(0)
    sampler = torch.utils.data.DistributedSampler(Stripes(96), num_replicas=1, rank=0, shuffle=True, seed=0)
    data = torch.utils.data.DataLoader(Stripes(96), batch_size=8, sampler=sampler)
    out = tmp_path / "run"
    capsnet.fit(Tiny(), data, test_data=Stripes(41, seed=1), epochs=2, out=out, batch_size=8, lr=1e-2, **QUIET)
    assert len(one_rank_ddp) == 1 and sampler.epoch == 1
    assert json.loads((out / "test.json").read_text())["last"]["n"] == 41
    assert load_state(out)["step"] == 2 * 12 and [r["epoch"] for r in read_summary(out)] == [1, 2]


# ------------------------------------------------------------------------------------------------ the README
def _readme_fit_example() -> str:
    """The Python block of docs/training.md that calls capsnet.fit on a Dataset of one's own."""
    text = (Path(__file__).parents[1] / "docs" / "training.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if "capsnet.fit(" in b]
    return block


def test_the_readmes_fit_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """On data of its format (an .npz of uint8 [N, 32, 32, 3] images and labels of 5 classes), one epoch."""
    rng = np.random.default_rng(0)
    for name, n in (("train.npz", 30), ("test.npz", 10)):
        np.savez(tmp_path / name, x=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), y=np.arange(n) % 5)
    code = _readme_fit_example()
    assert code.count("epochs=10") == 1
    monkeypatch.chdir(tmp_path)
    # one epoch of one pass (its 27 training images would otherwise repeat to 200 steps: MIN_EPOCH_STEPS)
    short = code.replace("epochs=10", "epochs=1, epoch_repeats=1")
    exec(compile(short, "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "runs" / "shapes" / "test.json").is_file()
    report = json.loads((tmp_path / "runs" / "shapes" / "test.json").read_text())
    assert report["selected_on"] == "val_loss" and report["best"]["n"] == 10
    assert "'metric': 'val_loss'" in capsys.readouterr().out


def test_a_resumed_fit_takes_the_settings_not_given_from_the_run(tmp_path):
    kw = dict(epochs=1, out=tmp_path / "run", **QUIET)
    capsnet.fit(_tiny(), Stripes(40), batch_size=8, lr=3e-3, lr_decay=0.5, **kw)
    capsnet.fit(_tiny(), Stripes(40), resume=True, **{**kw, "epochs": 2})  # no batch_size, lr, lr_decay
    meta = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (meta["batch_size"], meta["lr"], meta["lr_decay"], meta["epochs"]) == (8, 3e-3, 0.5, 2)
    assert [r["lr"] for r in read_summary(tmp_path / "run")] == pytest.approx([3e-3, 1.5e-3])
