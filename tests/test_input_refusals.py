"""The input contract's refusals and conversions end to end (docs/inputs.md): evaluate refuses another class count
in one line and converts channels and sizes with a note; it scores the subset a run's test.json scored; train
refuses --image-size for a reader that does not resize; fit on colour images, then predict on their PNG files; a
shipped weight fine-tuned to new classes with fit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SMALL_FLAGS, small_config
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

import capsnet
from capsnet import CapsNet, cli
from capsnet.data import Split, load_dataset, standins
from capsnet.models.hub import resolve_ref
from capsnet.models.recipe import model_input
from capsnet.training.evaluator import evaluate

QUIET = {"progress": False, "tensorboard": False, "device": "cpu"}
CLASS_COUNT = "(a class count is never converted; fine-tune: create_model(name, pretrained=..., n_classes=K), then fit)"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `root`: (size, mtime in ns), to tell that nothing was written."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _run_folder(folder: Path, **cfg) -> Path:
    """A run folder as training leaves it, made cheaply: an untrained small CapsNet in best/ and the record of its
    data (mnist-sample)."""
    CapsNet(config=small_config(**cfg)).save_pretrained(folder / "best")
    (folder / "config.json").write_text(json.dumps({"train": {"dataset": "mnist-sample"}}))
    return folder


# ------------------------------------------------------------------------------------------- class count
def test_evaluate_refuses_another_class_count_in_one_line_before_reading_an_image(tmp_path, capsys):
    run = _run_folder(tmp_path / "run")  # 10 classes, greyscale 28x28
    folder = standins.write_image_folder(tmp_path / "colour", per_class=4)  # 3 classes of 20x24 RGB PNGs
    before = _tree(tmp_path)
    for extra in ([], ["--json"]):
        assert cli.main(["evaluate", "--checkpoint", str(run), "--dataset", str(folder), *extra]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == f"capsnet evaluate: error: {folder}: 3 classes, the model has 10 {CLASS_COUNT}\n"
    assert _tree(tmp_path) == before  # nothing written, not even the folder's decoded-image cache


def test_evaluate_refuses_another_class_count_of_a_reader_without_class_folders(tmp_path, capsys):
    run = _run_folder(tmp_path / "run")
    data = standins.write_npz(tmp_path / "three.npz", n_train=6, n_test=6, n_classes=3, shape=(28, 28))
    assert cli.main(["evaluate", "--checkpoint", str(run), "--dataset", str(data)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"capsnet evaluate: error: {data}: 3 classes, the model has 10 {CLASS_COUNT}\n"


# ------------------------------------------------------------------------------------------- conversions
def _converted_test_split(root: Path, *, mode: str, size: tuple[int, int]) -> Split:
    """root/test/<class>/*.png read with Pillow directly: converted to `mode` (L or RGB) and resized (bilinear) to
    `size`, as the image-folder reader documents; labels by sorted class name."""
    from PIL import Image

    images, labels = [], []
    for k, name in enumerate(sorted(p.name for p in (root / "test").iterdir())):
        for path in sorted((root / "test" / name).glob("*.png")):
            with Image.open(path) as im:
                im = im.convert(mode)
            if im.size != (size[1], size[0]):
                im = im.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            arr = np.asarray(im, dtype=np.uint8)
            images.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
            labels.append(k)
    return Split(torch.from_numpy(np.stack(images)), torch.tensor(labels))


CONVERSIONS = {
    "rgb-to-grey": (dict(in_channels=1), dict(mode="RGB", size=(28, 28)), "L",
                    "RGB images converted to greyscale (Pillow's L), as training with --image-channels 1 reads them"),
    "grey-to-rgb": (dict(in_channels=3), dict(mode="L", size=(28, 28)), "RGB", "greyscale images converted to RGB"),
    "resize": (dict(in_channels=3), dict(mode="RGB", size=(20, 24)), "RGB",
               "images resized from 20x24 to 28x28, the size the model reads"),
}  # fmt: skip


@pytest.mark.parametrize("case", CONVERSIONS)
def test_evaluate_converts_an_image_folder_and_says_so(case, tmp_path, capsys):
    model_cfg, folder_cfg, mode, note = CONVERSIONS[case]
    model = CapsNet(config=small_config(n_classes=3, **model_cfg))
    model.save_pretrained(tmp_path / "model")
    root = standins.write_image_folder(tmp_path / "folder", per_class=8, **folder_cfg)  # 4 test images a class
    args = ["evaluate", "--checkpoint", str(tmp_path / "model"), "--dataset", str(root)]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("data: ")] == [f"data: {note}"]
    assert cli.main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    expected = evaluate(model, _converted_test_split(root, mode=mode, size=(28, 28)))
    assert r["conversions"] == [note] and r["n"] == expected["n"] == 12
    assert r["confusion"] == expected["confusion"] and r["accuracy"] == expected["accuracy"]
    assert r["loss"] == pytest.approx(expected["loss"], rel=1e-6)


# ------------------------------------------------------------------------------------------- the run's subset
@pytest.fixture(scope="module")
def subset_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("subset") / "run"
    args = ["train", "--dataset", "mnist-sample", "--train-subset", "64", "--test-subset", "40", "--epochs", "1",
            "--batch-size", "32", "--out", str(out), "--no-progress", "--no-tensorboard", *SMALL_FLAGS]  # fmt: skip
    assert cli.main(args) == 0
    return out


def test_evaluate_scores_the_test_subset_the_run_scored(subset_run, capsys):
    capsys.readouterr()
    scored = json.loads((subset_run / "test.json").read_text())
    note = "the first 40 test images, as the run scored (its --test-subset)"
    for view in ("best", "last"):
        assert cli.main(["evaluate", "--checkpoint", str(subset_run / view), "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["conversions"] == [note] and r["n"] == scored[view]["n"] == 40
        assert r["accuracy"] == pytest.approx(scored[view]["accuracy"], abs=1e-12)
        assert r["loss"] == pytest.approx(scored[view]["loss"], rel=1e-5)
    assert cli.main(["evaluate", "--checkpoint", str(subset_run)]) == 0
    assert f"data: {note}\n" in capsys.readouterr().out
    # Another data set named: all of its test split, no note.
    assert cli.main(["evaluate", "--checkpoint", str(subset_run), "--dataset", "mnist-sample", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["n"] == len(load_dataset("mnist-sample").test) and r["conversions"] == []


# ------------------------------------------------------------------------------------------- --image-size
def test_train_refuses_image_size_on_a_reader_that_does_not_resize(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert cli.main(["train", "--dataset", "mnist-sample", "--image-size", "32", "--out", str(out), "--epochs", "1",
                     "--no-progress", "--no-tensorboard", *SMALL_FLAGS]) == 2  # fmt: skip
    out_text, err = capsys.readouterr()
    assert err == ("capsnet train: error: --image-size 32: mnist-sample's images are 28x28 and its reader (idx) "
                   "does not resize them; drop --image-size\n")  # fmt: skip
    assert out_text == ""  # (the chosen batch size is announced only once the data fits)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------- fit, then predict
def _write_pngs(folder: Path, images: torch.Tensor) -> list[Path]:
    from PIL import Image

    folder.mkdir(parents=True)
    paths = [folder / f"{i:03d}.png" for i in range(len(images))]
    for path, image in zip(paths, images):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
    return paths


def test_fit_on_colour_images_then_predict_their_png_files(tmp_path, capsys):
    labels = np.arange(48) % 3
    images = torch.from_numpy(standins.pattern_images(labels, 3, 12, 12, seed=0))  # uint8 [48, 3, 12, 12]
    model = capsnet.create_model("capsnet", in_channels=3, image_size=12, n_classes=3, conv_channels=8,
                                 primary_types=2, primary_dim=4, class_dim=4, kernel_size=3,
                                 decoder_hidden=(16, 16))  # fmt: skip
    capsnet.fit(model, TensorDataset(images, torch.from_numpy(labels)), epochs=4, out=tmp_path / "run",
                batch_size=16, lr=3e-3, **QUIET)  # fmt: skip
    model.save_pretrained(tmp_path / "model")
    for saved in (tmp_path / "model", tmp_path / "run" / "best"):
        assert json.loads((saved / "config.json").read_text())["config"]["digits"] is False
    paths = _write_pngs(tmp_path / "png", images)
    capsys.readouterr()
    assert cli.main(["predict", "--checkpoint", str(tmp_path / "model"), *map(str, paths), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with torch.no_grad():
        out = model.eval()(model_input(model, images))
    assert [r["image"] for r in rows] == [str(p) for p in paths]
    assert [r["class"] for r in rows] == out.predictions.tolist()
    assert len(set(out.predictions.tolist())) > 1  # (trained: not one class for all)
    assert torch.allclose(torch.tensor([r["lengths"] for r in rows]), out.lengths, atol=1e-5, rtol=0)
    assert {r["conversion"] for r in rows} == {"as it is"}
    assert cli.main(["predict", "--checkpoint", str(tmp_path / "model"), str(paths[0])]) == 0
    assert "; input: as it is)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- fine-tuning
def _three_digits(n: int, *, offset: int = 0) -> TensorDataset:
    """The first `n` bundled test digits 0, 1 and 2 from `offset` (labels 0 ... 2): a 3-class set of 1x28x28."""
    test = load_dataset("mnist-sample").test
    keep = torch.nonzero(test.labels < 3).flatten()[offset : offset + n]
    return TensorDataset(test.images[keep], test.labels[keep])


@pytest.mark.slow
def test_fine_tuning_a_shipped_weight_to_three_classes_with_fit(tmp_path, capsys):
    shipped = load_file(resolve_ref("efficient-capsnet:mnist-sample") / "model.safetensors")
    model = capsnet.create_model("efficient-capsnet", pretrained="mnist-sample", n_classes=3)
    assert capsys.readouterr().err == ("capsnet: mnist-sample: 10 classes -> 3: re-initialised class_caps, "
                                       "decoder.net.0; every other weight loaded\n")  # fmt: skip
    state = model.state_dict()
    renewed = {k for k in state if k.startswith(("class_caps.", "decoder.net.0."))}
    assert renewed == {"class_caps.weight", "class_caps.prior", "decoder.net.0.weight", "decoder.net.0.bias"}
    assert state.keys() == shipped.keys()
    assert [k for k in state.keys() - renewed if not torch.equal(state[k], shipped[k])] == []
    class_dim = model.config.class_dim
    new_shapes = {k: tuple(state[k].shape) for k in renewed}
    assert new_shapes == {"class_caps.weight": (*shipped["class_caps.weight"].shape[:1], 3,
                                                *shipped["class_caps.weight"].shape[2:]),
                          "class_caps.prior": (shipped["class_caps.prior"].shape[0], 3),
                          "decoder.net.0.weight": (shipped["decoder.net.0.weight"].shape[0], 3 * class_dim),
                          "decoder.net.0.bias": tuple(shipped["decoder.net.0.bias"].shape)}  # fmt: skip
    assert shipped["class_caps.weight"].shape[1] == 10 and shipped["decoder.net.0.weight"].shape[1] == 10 * class_dim
    assert not torch.equal(state["decoder.net.0.bias"], shipped["decoder.net.0.bias"])  # the whole layer afresh

    train, val = _three_digits(24), _three_digits(12, offset=24)
    probe = copy.deepcopy(model).train()  # every parameter gets a gradient from the loss
    x, y = model_input(probe, train.tensors[0][:8]), train.tensors[1][:8]
    loss, _ = probe.loss(probe(x, y), x, y)
    loss.backward()
    assert [n for n, p in probe.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)] == []

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    capsnet.fit(model, train, val_data=val, epochs=1, epoch_repeats=1, out=tmp_path / "run", batch_size=8, **QUIET)
    assert [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])] == []
    model.save_pretrained(tmp_path / "tuned")
    for folder in (tmp_path / "tuned", tmp_path / "run" / "last"):
        loaded = capsnet.load_pretrained(folder)
        assert loaded.config.n_classes == 3 and loaded.config.class_names == ()
        with torch.no_grad():
            assert loaded(model_input(loaded, val.tensors[0][:4])).lengths.shape == (4, 3)
    loaded = capsnet.load_pretrained(tmp_path / "tuned")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
