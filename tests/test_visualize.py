import gzip
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from capsnet import CapsNet
from capsnet.cli import main
from capsnet.data import load_dataset
from capsnet.errors import CapsNetError, CheckpointError
from capsnet.training.checkpoint import resolve_checkpoint
from capsnet.viz.common import distinct_classes, load_capsnet, run_folder_of, select_examples
from capsnet.viz.figures import (
    PERTURBATION_OFFSETS,
    confusion_matrix,
    plot_confusion,
    plot_curves,
    plot_reconstructions,
    visualize,
)
from capsnet.viz.routing import routing_maps

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

FIGURES = ("reconstructions", "perturbation", "routing", "curves", "confusion")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY = (
    "epoch,train_loss,train_acc,test_loss,test_acc,lr,images_per_s,seconds\n"
    "1,0.30,0.90,0.25,0.91,0.001,500,60\n"
    "2,0.15,0.95,0.12,0.95,0.0009,510,59\n"
    "3,0.10,0.97,0.09,0.96,0.00081,505,60\n"
)


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes(), mtime=0))


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """A test-only MNIST-format folder with the first 30 bundled test digits (keeps the confusion matrix fast)."""
    folder = tmp_path_factory.mktemp("data")
    test = load_dataset("mnist-sample").test
    _write_idx(folder / "t10k-images-idx3-ubyte.gz", test.images[:30, 0].numpy())
    _write_idx(folder / "t10k-labels-idx1-ubyte.gz", test.labels[:30].numpy())
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A fake training run folder: best/ and last/ (an untrained CapsNet), summary.csv, config.json."""
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    CapsNet().save_pretrained(run / "best")
    shutil.copytree(run / "best", run / "last")
    (run / "summary.csv").write_text(SUMMARY)
    (run / "config.json").write_text('{"train": {}, "model": {}}\n')
    return run


@pytest.fixture(scope="module")
def figures(run_dir, small_data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("figures")
    return visualize(run_dir, out, data_dir=str(small_data), n=4, n_perturb=2, seed=0, log=lambda _: None)


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("name", FIGURES)
def test_figure_is_a_readable_nonblank_png(figures, name):
    path = figures[name]
    assert path.name == f"{name}.png" and path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = _pixels(path)
    height, width = pixels.shape[:2]
    assert width > 200 and height > 200
    assert pixels.std() > 10.0, f"{name}.png looks blank"
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (height, width)


@pytest.mark.slow
def test_same_seed_same_bytes_other_seed_other_digits(run_dir, small_data, figures, tmp_path):
    again = visualize(run_dir, tmp_path / "a", data_dir=str(small_data), n=4, n_perturb=2, seed=0, log=print)
    assert set(again) == set(FIGURES)
    for name in FIGURES:
        assert again[name].read_bytes() == figures[name].read_bytes(), name
    model, test = load_capsnet(run_dir), load_dataset(str(small_data)).test
    first, other = select_examples(test, 4, seed=0), select_examples(test, 4, seed=1)
    assert first.tolist() != other.tolist()
    path = plot_reconstructions(model, test.images[other], test.labels[other], tmp_path / "other.png")
    assert path.read_bytes() != figures["reconstructions"].read_bytes()


@pytest.mark.slow
def test_cli_writes_and_prints_every_figure(run_dir, small_data, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "visualize",
            "--checkpoint",
            str(run_dir),
            "--data-dir",
            str(small_data),
            "--out",
            str(out),
            "--n",
            "3",
            "--seed",
            "2",
            "--limit",
            "20",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    printed = captured.out.split()
    assert printed == [str(out / f"{name}.png") for name in FIGURES]
    assert all(Path(p).read_bytes()[:8] == PNG_SIGNATURE for p in printed)


@pytest.mark.slow
def test_save_pretrained_folder_skips_curves_with_a_note(run_dir, small_data, tmp_path, capsys):
    model_dir = shutil.copytree(run_dir / "best", tmp_path / "model")
    rc = main(
        [
            "visualize",
            "--checkpoint",
            str(model_dir),
            "--dataset",
            str(small_data),
            "--out",
            str(tmp_path / "out"),
            "--n",
            "2",
            "--limit",
            "10",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "curves.png" in captured.err and "not a training run folder" in captured.err
    assert not (tmp_path / "out" / "curves.png").exists()
    assert len(captured.out.split()) == 4


@pytest.mark.slow
def test_model_without_decoder_skips_reconstruction_figures(small_data, tmp_path):
    CapsNet(decoder=False).save_pretrained(tmp_path / "model")
    notes = []
    written = visualize(tmp_path / "model", tmp_path / "out", data_dir=str(small_data), n=2, limit=10, log=notes.append)
    assert set(written) == {"routing", "confusion"}
    assert any("no decoder" in note for note in notes)


def _bad_checkpoint(kind: str, run_dir: Path, tmp: Path) -> Path:
    if kind == "missing":
        return tmp / "nope"
    if kind == "file":
        (tmp / "file.txt").write_text("x")
        return tmp / "file.txt"
    if kind == "empty":
        (tmp / "empty").mkdir()
        return tmp / "empty"
    bad = shutil.copytree(run_dir / "best", tmp / "bad")
    if kind == "corrupt-weights":
        (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    else:  # corrupt-config
        (bad / "config.json").write_text("{not json")
    return bad


@pytest.mark.parametrize("kind", ["missing", "file", "empty", "corrupt-weights", "corrupt-config"])
def test_bad_checkpoint_exits_2_with_one_line(kind, run_dir, small_data, tmp_path, capsys):
    checkpoint = _bad_checkpoint(kind, run_dir, tmp_path)
    rc = main(
        ["visualize", "--checkpoint", str(checkpoint), "--data-dir", str(small_data), "--out", str(tmp_path / "out")]
    )
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("capsnet visualize: error: "), captured.err
    assert captured.out == ""


def test_bad_data_dir_exits_2_with_one_line(run_dir, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    for data in (tmp_path / "data", tmp_path / "missing"):
        rc = main(["visualize", "--checkpoint", str(run_dir), "--data-dir", str(data), "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("capsnet visualize: error: ")


def test_resolve_checkpoint(run_dir, tmp_path):
    assert resolve_checkpoint(run_dir) == run_dir / "best"
    assert resolve_checkpoint(run_dir / "last") == run_dir / "last"
    partial = tmp_path / "partial"
    shutil.copytree(run_dir / "last", partial / "last")
    (partial / "summary.csv").write_text(SUMMARY)
    assert resolve_checkpoint(partial) == partial / "last"  # no best/ yet
    assert run_folder_of(run_dir) == run_dir and run_folder_of(run_dir / "best") == run_dir
    assert run_folder_of(run_dir / "best" / "x") is None
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_checkpoint(tmp_path / "missing")
    started = tmp_path / "started"  # training began, nothing saved yet
    started.mkdir()
    (started / "config.json").write_text('{"train": {}, "model": {}}\n')
    with pytest.raises(CheckpointError, match="without a checkpoint yet"):
        resolve_checkpoint(started)


def test_routing_maps_follow_type_major_order():
    types, grid, classes = 32, 6, 10
    c = torch.zeros(types * grid * grid, classes)
    c[5 * 36 + 2 * 6 + 4, 3] = 32.0  # type 5, row 2, column 4 -> digit 3
    maps = routing_maps(c, types, grid)
    assert maps.shape == (classes, grid, grid)
    assert maps[3, 2, 4] == 1.0 and maps.sum() == 1.0


def test_distinct_classes_prefers_one_digit_per_class():
    labels = torch.tensor([8, 9, 8, 6, 9, 1])
    assert distinct_classes(labels, 3).tolist() == [0, 1, 3]
    assert distinct_classes(labels, 6).tolist() == [0, 1, 3, 5, 2, 4]
    assert distinct_classes(labels[:1], 3).tolist() == [0]


def test_perturbation_offsets_are_the_papers():
    assert len(PERTURBATION_OFFSETS) == 11
    assert PERTURBATION_OFFSETS[0] == -0.25 and PERTURBATION_OFFSETS[-1] == 0.25 and 0.0 in PERTURBATION_OFFSETS


def test_plot_functions_take_plain_inputs(tmp_path):
    confusion = [[5, 1, 0], [0, 4, 2], [1, 0, 7]]  # as evaluate_checkpoint returns it
    path = plot_confusion(confusion, tmp_path / "cm.png")
    assert path == tmp_path / "cm.png" and path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(CapsNetError, match="square"):
        plot_confusion([[1, 2]], tmp_path / "x.png")
    (tmp_path / "summary.csv").write_text(SUMMARY.splitlines()[0] + "\n")
    with pytest.raises(CheckpointError, match="no epochs"):
        plot_curves(tmp_path, tmp_path / "curves.png")


def test_the_curves_are_titled_with_the_runs_data_set(tmp_path, monkeypatch):
    from capsnet.viz import figures

    titles = []
    monkeypatch.setattr(figures, "_save", lambda fig, out: titles.append(fig._suptitle.get_text()) or Path(out))
    run = tmp_path / "mnist"  # a run folder whose name is not its data set's
    run.mkdir()
    (run / "summary.csv").write_text(SUMMARY)
    plot_curves(run, tmp_path / "a.png")
    (run / "config.json").write_text(json.dumps({"train": {"dataset": "mnist-sample"}}))
    plot_curves(run, tmp_path / "b.png")
    plot_curves(run, tmp_path / "c.png", dataset="fashion-mnist")
    assert [t.split(",")[0] for t in titles] == [
        "Training curves (mnist",
        "Training curves (mnist-sample",
        "Training curves (fashion-mnist",
    ]


def test_missing_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes `from matplotlib.figure import` fail
    with pytest.raises(CapsNetError, match=r"pip install 'capsnet\[viz\]'"):
        plot_confusion([[1]], tmp_path / "cm.png")


def test_confusion_matrix_counts_predictions_as_evaluate_does(run_dir):
    model = load_capsnet(run_dir)
    test = load_dataset("mnist-sample").test
    cm = confusion_matrix(model, test, batch_size=7, limit=20)
    with torch.no_grad():
        pred = model(test.images[:20].float() / 255).predictions
    expected = torch.zeros(10, 10, dtype=torch.long)
    for y, p in zip(test.labels[:20].tolist(), pred.tolist()):
        expected[y, p] += 1
    assert cm.dtype == torch.long and torch.equal(cm, expected)


def test_image_folders_are_read_at_the_models_recorded_size_and_channels(tmp_path):
    """The folder's images are 20x24 RGB; the model was trained on them converted to 16x16 grey: visualize converts
    them so, as evaluate does (the same function), instead of refusing the folder's own size."""
    from capsnet.data import standins
    from capsnet.inference import evaluate_checkpoint
    from capsnet.models.baseline import BaselineCNN

    root = standins.write_image_folder(tmp_path / "imgs", per_class=4)
    BaselineCNN(in_channels=1, image_size=16, n_classes=3, channels=(4, 4), hidden=(8, 8)).save_pretrained(
        tmp_path / "model"
    )
    written = visualize(tmp_path / "model", tmp_path / "out", dataset=str(root), n=2, log=lambda _: None)
    assert written["confusion"].is_file()
    assert evaluate_checkpoint(tmp_path / "model", dataset=str(root))["n"] == 6
