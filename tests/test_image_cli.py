"""The command line on image data: multi-checkpoint (ensemble) evaluation, predict on a non-digit model, class
names, `data info` defaults, and bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from capsnet import CapsNet, CapsNetConfig, cli
from capsnet.data import load_dataset, standins
from capsnet.inference import Ensemble
from capsnet.models.recipe import model_input
from capsnet.pixels import to_float

SMALL = dict(conv_channels=8, kernel_size=5, primary_types=2, primary_dim=4, class_dim=6, decoder=False)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))


def saved_models(tmp_path, n=2, **cfg):
    paths = []
    for k in range(n):
        torch.manual_seed(k)
        model = CapsNet(config=CapsNetConfig(**{**SMALL, **cfg}))
        paths.append(model.save_pretrained(tmp_path / f"m{k}"))
    return paths


def test_ensemble_evaluation_averages_capsule_lengths(tmp_path, capsys):
    data = standins.write_npz(tmp_path / "d.npz", n_train=4, n_test=12, n_classes=3, shape=(16, 16, 3))
    paths = saved_models(tmp_path, in_channels=3, image_size=16, n_classes=3, class_names=("a", "b", "c"),
                         digits=False)  # fmt: skip
    args = ["evaluate", "--dataset", str(data), "--json"]
    assert cli.main([*args, "--checkpoint", str(paths[0]), "--checkpoint", str(paths[1])]) == 0
    r = json.loads(capsys.readouterr().out)
    models = [CapsNet.from_pretrained(p) for p in paths]
    test = load_dataset(str(data)).test
    with torch.no_grad():
        mean = torch.stack([m(to_float(test.images)).lengths for m in models]).mean(0)
    expected = (mean.argmax(1) == test.labels).float().mean().item()
    assert r["accuracy"] == pytest.approx(expected) and r["n"] == 12 and len(r["checkpoint"]) == 2
    assert r["class_names"] == ["a", "b", "c"]
    assert cli.main(["evaluate", "--dataset", str(data), "--checkpoint", str(paths[0])]) == 0
    out = capsys.readouterr().out
    assert "a:" in out and "classes: 0=a  1=b  2=c" in out


def test_ensemble_refuses_mismatched_models(tmp_path, capsys):
    a = saved_models(tmp_path / "a", n=1, in_channels=3, image_size=16, n_classes=3)[0]
    b = saved_models(tmp_path / "b", n=1, in_channels=3, image_size=16, n_classes=4)[0]
    data = standins.write_npz(tmp_path / "d.npz", n_classes=3, shape=(16, 16, 3))
    assert cli.main(["evaluate", "--dataset", str(data), "--checkpoint", str(a), "--checkpoint", str(b)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_classes 4" in err[0]
    with pytest.raises(Exception, match="at least one"):
        Ensemble([])


def test_predict_resizes_like_the_training_data_and_names_the_class(tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image")
    path = saved_models(tmp_path, n=1, in_channels=3, image_size=24, n_classes=3, source_size=(32, 32),
                        class_names=("cat", "dog", "fox"), digits=False)[0]  # fmt: skip
    img = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (250, 250, 250)).save(img)  # white: a digit model would invert it
    from capsnet.inference import prepare_image

    model = CapsNet.from_pretrained(path)
    x, how = prepare_image(img, model.config)
    assert x.shape == (3, 32, 32) and x.min() > 0.95 and how == "resized from 48x64 to 32x32, centre-cropped to 24x24"
    assert model_input(model, x[None]).shape == (1, 3, 24, 24)  # the recipe crops
    assert cli.main(["predict", "--checkpoint", str(path), str(img)]) == 0
    out = capsys.readouterr().out
    assert out.count("(cat)") + out.count("(dog)") + out.count("(fox)") == 1
    assert "input: resized from 48x64 to 32x32, centre-cropped to 24x24" in out
    digit = saved_models(tmp_path / "digit", n=1, digits=True)[0]
    y, how = prepare_image(img, CapsNet.from_pretrained(digit).config)
    assert y.shape == (1, 28, 28) and y.max() < 0.05  # MNIST preprocessing: white paper becomes black
    assert how.startswith("digit-style: MNIST's procedure")


def test_data_info_shows_default_augmentation(tmp_path, capsys):
    folder = standins.write_cifar(tmp_path / "c10")
    assert cli.main(["data", "info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "augmentation (default): crop=24x24,flip,brightness=0.247059,contrast=0.2:1.8,standardize" in out
    assert "airplane" in out


@pytest.mark.parametrize("case", ["empty_class", "one_class", "pickled", "bad_npz", "too_small"])
def test_bad_input_through_train_is_one_line_exit_2_nothing_written(tmp_path, capsys, case):
    if case in ("empty_class", "one_class"):
        pytest.importorskip("PIL")
    root = tmp_path / "data"
    if case == "empty_class":
        standins.write_image_folder(root, per_class=2)
        (root / "train" / "owl").mkdir()
    elif case == "one_class":
        standins.write_image_folder(root, classes=("solo",), per_class=2)
    elif case == "pickled":
        root.mkdir()
        (root / "data_batch_1").write_bytes(b"\x80\x02}q\x00.")
    elif case == "bad_npz":
        root = tmp_path / "bad.npz"
        np.savez(root, x_train=np.zeros((3, 8, 8), np.uint8), y_train=np.zeros(2, np.int64),
                 x_test=np.zeros((2, 8, 8), np.uint8), y_test=np.array([0, 1]))  # fmt: skip
    else:
        root = standins.write_npz(tmp_path / "tiny.npz", shape=(6, 6, 3))
    out = tmp_path / "run"
    code = cli.main(["train", "--dataset", str(root), "--out", str(out), "--epochs", "1", "--device", "cpu",
                     "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("capsnet train: error:"), err
    assert not out.exists()


def test_memory_estimate_stops_oversized_training_before_allocating(tmp_path, capsys, monkeypatch):
    from capsnet.errors import ConfigError
    from capsnet.models import memory

    big = CapsNetConfig(in_channels=3, image_size=224)
    small = CapsNetConfig(in_channels=3, image_size=224, conv1_stride=2)
    assert memory.capsnet_bytes(big, 32) > 2 * memory.capsnet_bytes(small, 32)  # a stride shrinks the activations
    est = [memory.capsnet_bytes(big, b) for b in (0, 16, 32)]  # parameters and Adam, plus a per-image share
    assert est[0] < est[1] < est[2] and est[0] > 4 * 4 * 8e6  # parameters, gradients and Adam: 4 copies
    with pytest.raises(ConfigError, match="--conv1-stride 2, a smaller --image-size") as e:
        memory.check_memory(big, 32, torch.device("cpu"), budget=8 << 30)
    assert "\n" not in str(e.value)
    assert memory.check_memory(CapsNetConfig(), 16, torch.device("cpu"), budget=8 << 30) < 8 << 30
    monkeypatch.setattr(memory, "budget_bytes", lambda device: 1 << 20)
    data = standins.write_npz(tmp_path / "d.npz", shape=(28, 28, 3))
    out = tmp_path / "run"
    code = cli.main(["train", "--dataset", str(data), "--out", str(out), "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "GiB free on cpu" in err[0] and not out.exists()


def test_single_folder_run_is_evaluated_on_its_own_held_out_split(tmp_path, capsys):
    pytest.importorskip("PIL")
    standins.write_image_folder(tmp_path / "imgs", per_class=6, split=False)
    out = tmp_path / "run"
    args = [
        "train",
        "--dataset",
        str(tmp_path / "imgs"),
        "--image-size",
        "16x20",
        "--image-channels",
        "1",
        "--test-fraction",
        "0.34",
        "--epochs",
        "1",
        "--epoch-repeats",
        "1",
        "--batch-size",
        "6",
        "--conv-channels",
        "8",
        "--primary-types",
        "2",
        "--kernel-size",
        "5",
        "--out",
        str(out),
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert cli.main(args) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["model"]["image_size"] == [16, 20] and meta["model"]["class_names"] == ["cat", "dog", "fox"]
    assert meta["validation"]["n"] == 1  # round(0.1 · 12) of the 12 training images, at least one
    assert "deprecated" not in capsys.readouterr().err
    assert cli.main(["evaluate", "--checkpoint", str(out), "--dataset", str(tmp_path / "imgs"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 6  # 2 of each class's 6, as in training
    # The old spelling: --val-fraction alone on such a folder now sets the validation share, and says so.
    args[args.index("--test-fraction")] = "--val-fraction"
    args[args.index("--out") + 1] = str(tmp_path / "run2")
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "--val-fraction now holds out validation images" in err and "--test-fraction" in err
    meta = json.loads((tmp_path / "run2" / "config.json").read_text())
    assert meta["train"]["val_fraction"] == 0.34 and meta["train"]["test_fraction"] == 0.1
    assert meta["validation"]["n"] == 5  # round(0.34 · 15) of the 15 training images (3 of 18 for testing)


def test_data_check_covers_every_source(tmp_path, capsys):
    norb = standins.write_smallnorb(tmp_path / "norb", n_train=6, n_test=6)
    assert cli.main(["data", "check", str(norb)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK  ") == 7 and "md5 " in out and "smallnorb: train 6, test 6, images 2×48×48, 5 classes" in out
    cifar = standins.write_cifar(tmp_path / "c10")
    path = cifar / "test_batch.bin"
    path.write_bytes(path.read_bytes()[:-1])
    assert cli.main(["data", "check", str(cifar)]) == 2
    captured = capsys.readouterr()
    assert "FAIL  content" in captured.out and "not a whole number" in captured.out
    assert len(captured.err.strip().splitlines()) == 1
    npz = standins.write_npz(tmp_path / "x.npz")
    assert cli.main(["data", "check", str(npz)]) == 0
    assert "npz: train 40, test 20" in capsys.readouterr().out


def test_data_check_gives_each_class_folder_a_checksum_that_follows_its_files(tmp_path, capsys):
    pytest.importorskip("PIL")
    root = standins.write_image_folder(tmp_path / "imgs", per_class=2)

    def digests() -> dict[str, str]:
        assert cli.main(["data", "check", str(root)]) == 0
        lines = [line.split() for line in capsys.readouterr().out.splitlines() if ", md5 " in line]
        return {words[1]: words[-1] for words in lines if words[1].endswith("/") and words[1].count("/") == 2}

    before = digests()
    assert sorted(before) == [f"{part}/{c}/" for part in ("test", "train") for c in ("cat", "dog", "fox")]
    assert len(set(before.values())) == len(before)  # different images, different checksums
    assert digests() == before  # stable
    image = sorted((root / "train" / "dog").iterdir())[0]
    image.write_bytes(image.read_bytes() + b"\0")  # one byte more in one file
    after = digests()
    assert after["train/dog/"] != before["train/dog/"]
    assert {k: v for k, v in after.items() if k != "train/dog/"} == {
        k: v for k, v in before.items() if k != "train/dog/"
    }


def test_visualize_a_cropping_stereo_model_prints_class_names(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from capsnet.data.smallnorb import CLASS_NAMES

    norb = standins.write_smallnorb(tmp_path / "norb", n_train=4, n_test=6)
    path = saved_models(tmp_path, n=1, in_channels=2, image_size=32, n_classes=5, source_size=(48, 48),
                        class_names=CLASS_NAMES, digits=False, decoder=True, decoder_hidden=(8,))[0]  # fmt: skip
    assert cli.main(["visualize", "--checkpoint", str(path), "--dataset", str(norb), "--out", str(tmp_path / "f"),
                     "--n", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "reconstructions.png" in out and "classes: 0=animal  1=human" in out
