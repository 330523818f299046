"""`capsnet convert`: the converter registry and the Efficient-CapsNet authors' Keras weights.

The numeric checks compare the converted model with an independent float64 NumPy transcription of the authors'
Keras forward pass (tests/keras_reference.py), on files written here in the layout of theirs and, where the
workplace has it, on their published smallNORB file: `$CAPSNET_AUTHORS_WEIGHTS/efficient-capsnet/
efficient_capsnet_SMALLNORB.h5`, by default `../shared/weights/` beside the repository (skipped when absent).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from keras_reference import VARIANTS, classifier, generator, random_weights, resize_bilinear, write_h5

from capsnet import load_pretrained
from capsnet.cli import main
from capsnet.data import standins
from capsnet.data.smallnorb import CLASS_NAMES
from capsnet.errors import ConfigError
from capsnet.models.converters import CONVERTERS, convert
from capsnet.models.converters.efficient_capsnet_keras import SMALLNORB_CLASSES
from capsnet.models.efficient_capsnet import EfficientCapsNet

pytest.importorskip("h5py")

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS_DIR = Path(os.environ.get("CAPSNET_AUTHORS_WEIGHTS", ROOT.parent / "shared" / "weights"))
AUTHORS_SMALLNORB = WEIGHTS_DIR / "efficient-capsnet" / "efficient_capsnet_SMALLNORB.h5"


def keras_inputs(variant: str, n: int = 4, seed: int = 1) -> np.ndarray:
    """float NHWC inputs of the variant's size: standardized-looking for smallNORB, [0, 1] images otherwise."""
    v = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    shape = (n, v["side"], v["side"], v["channels"])
    x = rng.standard_normal(shape) if variant == "smallnorb" else rng.uniform(0, 1, shape) ** 3
    return x.astype(np.float32).astype(np.float64)


def run_converted(folder: Path, x_nhwc: np.ndarray):
    model = load_pretrained(folder)
    with torch.no_grad():
        out = model(torch.from_numpy(x_nhwc.transpose(0, 3, 1, 2)).float())  # NCHW here
    return model, out


def one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------------- registry
def test_registry_and_help_list_the_formats(capsys):
    assert "efficient-capsnet" in CONVERTERS and CONVERTERS["efficient-capsnet"].description
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in CONVERTERS) and "Keras .h5" in out
    with pytest.raises(ConfigError, match="unknown weights format"):
        convert("no-such-format", "x.h5", "out")


def test_smallnorb_class_names_match_the_reader():
    assert SMALLNORB_CLASSES == CLASS_NAMES


# ----------------------------------------------------------------------------------------- synthetic files
@pytest.mark.parametrize("variant", ["mnist", "smallnorb", "multimnist"])
def test_converted_model_equals_the_keras_forward(tmp_path, variant):
    w = random_weights(variant, seed=3)
    path = write_h5(tmp_path / f"{variant}.h5", w, variant)
    convert("efficient-capsnet", path, tmp_path / "m")  # variant read from the shapes
    x = keras_inputs(variant)
    model, out = run_converted(tmp_path / "m", x)
    caps, lengths = classifier(w, x, variant)
    assert type(model) is EfficientCapsNet and model.config.n_classes == VARIANTS[variant]["classes"]
    np.testing.assert_allclose(out.lengths.numpy(), lengths, atol=1e-4, rtol=0)
    assert (out.predictions.numpy() == lengths.argmax(1)).all()
    recon = out.reconstructions.numpy().transpose(0, 2, 3, 1)  # back to NHWC
    np.testing.assert_allclose(recon, generator(w, caps, variant), atol=1e-4, rtol=0)


def test_whole_model_files_are_read_too(tmp_path):
    w = random_weights("multimnist")
    convert("efficient-capsnet", write_h5(tmp_path / "m.h5", w, "multimnist", whole_model=True), tmp_path / "m")
    x = keras_inputs("multimnist", n=2)
    _, out = run_converted(tmp_path / "m", x)
    np.testing.assert_allclose(out.lengths.numpy(), classifier(w, x, "multimnist")[1], atol=1e-4, rtol=0)


def test_recorded_preprocessing_of_each_variant(tmp_path):
    for variant in ("mnist", "smallnorb", "multimnist"):
        path = write_h5(tmp_path / f"{variant}.h5", random_weights(variant), variant)
        cfg = convert("efficient-capsnet", path, tmp_path / variant).config
        meta = json.loads((tmp_path / variant / "config.json").read_text())["config"]
        assert meta["backbone_order"] == "conv-act-norm" and meta["norm_eps"] == 1e-3 and meta["length_eps"] == 1e-7
        if variant == "smallnorb":
            assert cfg.channel_standardize and cfg.source_size == (64, 64) and not cfg.digits
            assert cfg.decoder_type == "conv" and cfg.class_names == CLASS_NAMES
        else:
            assert not cfg.channel_standardize and cfg.digits and cfg.decoder_type == "fc"
            assert cfg.input_divisor == (256.0 if variant == "mnist" else 255.0)  # their MNIST / MultiMNIST code


def test_explicit_variant_must_match_the_shapes(tmp_path, capsys):
    path = write_h5(tmp_path / "m.h5", random_weights("mnist"), "mnist")
    argv = ["convert", "efficient-capsnet", str(path), "--out", str(tmp_path / "o"), "--variant", "multimnist"]
    one_line_exit_2(capsys, argv, "CapsNet/conv2d_8/kernel:0 has shape [9, 9, 1, 128], expected [5, 5, 1, 128]")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"drop": "CapsNet/digit_caps/b:0"}, "missing tensor CapsNet/digit_caps/b:0 (shape [10, 16, 1])"),
        ({"drop": "CapsNet/batch_normalization_2/moving_variance:0"},
         "missing tensor CapsNet/batch_normalization_2/moving_variance:0"),
        ({"drop": "Generator/dense_1/kernel:0"}, "missing tensor Generator/dense_1/kernel:0 (shape [512, 1024])"),
        ({"reshape": ("CapsNet/digit_caps/W:0", (10, 16, 8, 8))},
         "CapsNet/digit_caps/W:0 has shape [10, 16, 8, 8], expected [10, 16, 8, 16]"),
        ({"reshape": ("Generator/dense_2/bias:0", (700,))}, "Generator/dense_2/bias:0 has shape [700], expected [784]"),
    ],
)  # fmt: skip
def test_missing_or_misshapen_tensors_are_named(tmp_path, capsys, change, message):
    path = write_h5(tmp_path / "m.h5", random_weights("mnist"), "mnist", **change)
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", str(path), "--out", str(tmp_path / "o")], message)
    assert not (tmp_path / "o").exists()  # nothing written


def test_files_that_are_not_the_authors_weights(tmp_path, capsys):
    import h5py

    text = tmp_path / "weights.h5"
    text.write_text("not hdf5\n")
    out = ["--out", str(tmp_path / "o")]
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", str(text), *out], "not an HDF5 file")
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", str(tmp_path / "none.h5"), *out], "no such file")
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f.create_dataset("x", data=np.zeros(3))
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", str(tmp_path / "plain.h5"), *out], "no 'layer_names'")
    w = {k: v for k, v in random_weights("mnist").items() if not k.startswith("caps/")}
    write_h5(tmp_path / "nocaps.h5", w, "mnist")
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", str(tmp_path / "nocaps.h5"), *out], "no capsule layer")
    w = random_weights("mnist")
    w["caps/W"] = np.zeros((7, 16, 8, 16))  # 7 classes: no variant of theirs
    w["caps/b"] = np.zeros((7, 16, 1))
    write_h5(tmp_path / "seven.h5", w, "mnist")
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", str(tmp_path / "seven.h5"), *out], "pass --variant")


def test_an_existing_model_is_kept_unless_overwrite(tmp_path, capsys):
    path = write_h5(tmp_path / "m.h5", random_weights("mnist"), "mnist")
    argv = ["convert", "efficient-capsnet", str(path), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert "EfficientCapsNet (1,573,168 parameters, 1×28×28 inputs, 10 classes)" in capsys.readouterr().out
    before = (tmp_path / "o" / "model.safetensors").read_bytes()
    one_line_exit_2(capsys, argv, "already holds a model")
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == before
    assert main([*argv, "--overwrite"]) == 0


def test_missing_h5py_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)
    one_line_exit_2(capsys, ["convert", "efficient-capsnet", "w.h5", "--out", str(tmp_path / "o")],
                    "needs h5py: pip install 'capsnet[convert]'")  # fmt: skip


def test_converted_smallnorb_model_evaluates_on_smallnorb_files(tmp_path, capsys):
    """evaluate feeds it what the authors' pipeline fed theirs: the test split standardized per channel with its own
    statistics, resized 96 -> 64, centre 48×48 crops."""
    w = random_weights("smallnorb", seed=5)
    convert("efficient-capsnet", write_h5(tmp_path / "n.h5", w, "smallnorb"), tmp_path / "m")
    norb = standins.write_smallnorb(tmp_path / "norb", n_train=4, n_test=6)
    assert main(["evaluate", "--checkpoint", str(tmp_path / "m"), "--dataset", str(norb), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    from capsnet.data.smallnorb import read_matrix

    dat = read_matrix(next(norb.glob("*testing-dat*"))).astype(np.float64)  # [6, 2, 96, 96]
    mean, std = dat.mean(axis=(0, 2, 3), keepdims=True), dat.std(axis=(0, 2, 3), keepdims=True)
    x = (np.round(resize_bilinear(dat, 64)) - mean) / std  # the reader keeps uint8: rounded after the resize
    _, lengths = classifier(w, x[:, :, 8:56, 8:56].transpose(0, 2, 3, 1), "smallnorb")
    labels = read_matrix(next(norb.glob("*testing-cat*")))
    assert result["n"] == 6 and result["accuracy"] == pytest.approx((lengths.argmax(1) == labels).mean())


# ----------------------------------------------------------------------------------------- the authors' file
@pytest.mark.skipif(not AUTHORS_SMALLNORB.is_file(), reason=f"the authors' weights are not at {AUTHORS_SMALLNORB}")
def test_authors_smallnorb_weights_equal_their_forward_pass(tmp_path):
    import h5py

    convert("efficient-capsnet", AUTHORS_SMALLNORB, tmp_path / "m")  # strict load inside; variant from shapes
    model = load_pretrained(tmp_path / "m")
    assert model.config.n_classes == 5 and model.config.decoder_type == "conv"
    with h5py.File(AUTHORS_SMALLNORB, "r") as f:
        names = {"CapsNet": ("conv2d_4", "conv2d_5", "conv2d_6", "conv2d_7"), "Generator": ("dense", "conv2d")}
        assert set(names) <= {n.decode() for n in f.attrs["layer_names"]}
        w = {}
        for k in range(4):
            for p in ("kernel", "bias"):
                w[f"conv{k}/{p}"] = np.asarray(f[f"CapsNet/conv2d_{4 + k}/{p}:0"], np.float64)
            for p in ("gamma", "beta"):
                w[f"norm{k}/{p}"] = np.asarray(f[f"CapsNet/instance_normalization{f'_{k}' if k else ''}/{p}:0"])
        for ours, theirs in (("dw/kernel", "conv2d_8/kernel"), ("dw/bias", "conv2d_8/bias"), ("caps/W", "digit_caps/W"),
                             ("caps/b", "digit_caps/b")):  # fmt: skip
            w[ours] = np.asarray(f[f"CapsNet/{theirs}:0"], np.float64)
        gen = ["dense", "conv2d", "conv2d_1", "conv2d_2", "conv2d_3"]
        for k, layer in enumerate(gen):
            for p in ("kernel", "bias"):
                w[f"gen{k}/{p}"] = np.asarray(f[f"Generator/{layer}/{p}:0"], np.float64)
    x = keras_inputs("smallnorb", n=16, seed=7)  # their inputs are standardized patches: roughly N(0, 1)
    _, out = run_converted(tmp_path / "m", x)
    caps, lengths = classifier(w, x, "smallnorb")
    np.testing.assert_allclose(out.lengths.numpy(), lengths, atol=1e-4, rtol=0)
    assert (out.predictions.numpy() == lengths.argmax(1)).all()
    recon = out.reconstructions.numpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(recon, generator(w, caps, "smallnorb"), atol=1e-4, rtol=0)
    # The check has teeth: the other block order (normalisation before the activation) is far off.
    other = EfficientCapsNet(config=type(model.config)(**{**vars(model.config), "backbone_order": "conv-norm-act"}))
    other.load_state_dict({_norm_before_act(k): v for k, v in model.state_dict().items()}, strict=True)
    with torch.no_grad():
        far = other.eval()(torch.from_numpy(x.transpose(0, 3, 1, 2)).float()).lengths.numpy()
    assert np.abs(far - lengths).max() > 0.05


def _norm_before_act(key: str) -> str:
    """A state-dict key of the conv-act-norm backbone (norms at 2, 5, 8, 11) in the conv-norm-act one (1, 4, ...)."""
    part = key.split(".")
    if part[0] == "backbone" and int(part[1]) % 3 == 2:
        part[1] = str(int(part[1]) - 1)
    return ".".join(part)
