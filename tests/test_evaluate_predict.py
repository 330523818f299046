import json

import numpy as np
import pytest
import torch
from helpers import small_config

from capsnet import CapsNet
from capsnet.cli import main
from capsnet.data import Split, load_dataset
from capsnet.data.images import load_image
from capsnet.errors import DatasetError
from capsnet.inference import evaluate_checkpoint
from capsnet.training.api import train
from capsnet.training.checkpoint_data import check_split
from capsnet.training.config import TrainConfig
from capsnet.training.evaluator import evaluate


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    cfg = TrainConfig(
        out=str(out), train_subset=128, test_subset=64, batch_size=32, epochs=1, progress=False, tensorboard=False
    )
    train(cfg, small_config())
    return out


@pytest.mark.slow
def test_evaluate_counts_and_confusion(run_dir):
    r = evaluate_checkpoint(run_dir, dataset="mnist-sample")
    assert r["n"] == 2000
    conf = np.array(r["confusion"])
    assert conf.shape == (10, 10) and conf.sum() == 2000
    assert r["accuracy"] == pytest.approx(np.trace(conf) / 2000)
    counts = conf.sum(axis=1)
    assert counts.tolist() == [192, 205, 204, 217, 209, 174, 212, 206, 170, 211]
    assert r["per_class"][3] == pytest.approx(conf[3, 3] / counts[3])


@pytest.mark.slow
def test_evaluate_matches_direct_predictions():
    model = CapsNet(config=small_config()).eval()
    split = load_dataset("mnist-sample").test
    r = evaluate(model, split, batch_size=300)
    with torch.no_grad():
        pred = model(split.images[:2000].float() / 255).predictions
    assert r["accuracy"] == pytest.approx((pred == split.labels).float().mean().item())


@pytest.mark.slow
def test_evaluate_cli_json_and_table(run_dir, capsys):
    assert main(["evaluate", "--checkpoint", str(run_dir), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"accuracy", "n", "per_class", "confusion"} <= set(r) and len(r["per_class"]) == 10
    assert main(["evaluate", "--checkpoint", str(run_dir / "last"), "--split", "train"]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "confusion matrix" in out and "(6000 images)" in out


def _write_digit(path, image, *, invert=False, size=(28, 28)):
    from PIL import Image

    arr = image.squeeze(0).numpy()
    if invert:
        arr = 255 - arr
    Image.fromarray(arr).resize(size).save(path)


def test_predict_png_and_jpeg_of_any_size(run_dir, tmp_path, capsys):
    split = load_dataset("mnist-sample").test
    _write_digit(tmp_path / "a.png", split.images[0])
    _write_digit(tmp_path / "b.jpg", split.images[1], invert=True, size=(90, 60))  # dark ink on white, 90x60
    assert (
        main(["predict", "--checkpoint", str(run_dir), str(tmp_path / "a.png"), str(tmp_path / "b.jpg"), "--json"]) == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert 0 <= row["class"] < 10 and len(row["lengths"]) == 10
        assert row["class"] == int(np.argmax(row["lengths"]))
    assert main(["predict", "--checkpoint", str(run_dir), str(tmp_path / "a.png")]) == 0
    assert "class" in capsys.readouterr().out


def test_load_image_is_mnist_like(tmp_path):
    split = load_dataset("mnist-sample").test
    _write_digit(tmp_path / "d.png", split.images[0], invert=True, size=(56, 56))
    x = load_image(tmp_path / "d.png")
    assert x.shape == (1, 28, 28) and x.min() >= 0 and x.max() <= 1
    assert x[:, :2].max() < 0.1 and x[:, :, :2].max() < 0.1  # background black after inversion, margins empty
    assert x.mean() > 0.03


def test_predict_bad_image_one_line(run_dir, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["predict", "--checkpoint", str(run_dir), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable" in err[0]
    assert main(["predict", "--checkpoint", str(run_dir), str(tmp_path / "missing.png")]) == 2


def test_check_split_names_the_mismatch():
    model = CapsNet(config=small_config())
    test = load_dataset("mnist-sample").test
    check_split(model, test, source="here")  # fits: no error
    wrong_size = Split(torch.zeros(2, 1, 30, 30, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(DatasetError, match="here: images are 1x30x30, the model expects 1x28x28"):
        check_split(model, wrong_size, source="here")
    with pytest.raises(DatasetError, match="here: labels go up to 12, the model has 10 classes"):
        check_split(model, Split(test.images[:3], torch.tensor([0, 12, 3])), source="here")
