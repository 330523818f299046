"""The front door (capsnet.inference): one input contract for forward, preprocess, predict, `capsnet predict`, the
exported graph and the ensemble, for every registered model; evaluate on a Split, a Dataset and batches."""

from __future__ import annotations

import json

import pytest
import torch
from test_input_contract import N, _png, model_for, raw_images, spec_for

import capsnet
from capsnet.cli import main
from capsnet.data.split import Split
from capsnet.errors import DatasetError
from capsnet.training.classification import ClassificationTask

KIND = "channel-standardize"  # the recipe where a wrong conversion changes the whole prediction


def _model(name: str, kind: str = KIND):
    raw, labels = raw_images(), torch.arange(N) % 10
    task = ClassificationTask(train=Split(raw, labels), test=Split(raw, labels), augment=spec_for(kind))
    return model_for(name, task), raw, labels


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-5)


# (a save and a command line per model; capsnet's, with its export, runs in the quick suite)
MODELS = [name if name == "capsnet" else pytest.param(name, marks=pytest.mark.slow) for name in capsnet.list_models()]


@pytest.mark.parametrize("name", MODELS)
def test_predict_the_command_line_the_onnx_graph_and_an_ensemble_agree(name, tmp_path, capsys):
    model, raw, _ = _model(name)
    assert model.config.channel_standardize and len(model.config.channel_std) == 1  # (recorded: predict reads it)
    p = capsnet.predict(model, raw)
    assert p.classes.dtype == torch.int64 and p.classes.shape == (N,) and p.lengths.shape == (N, 10)
    assert p.names == [str(int(k)) for k in p.classes] and torch.equal(p.classes, p.lengths.argmax(1))
    with torch.no_grad():
        close(model(capsnet.preprocess(model, raw)).lengths, p.lengths)  # forward on the prepared input
    close(capsnet.predict(model, raw.float() / 255).lengths, p.lengths)  # x01 floats: the same images
    close(capsnet.predict(capsnet.Ensemble([model]), raw).lengths, p.lengths)
    # `capsnet predict FILES` on the saved model
    model.save_pretrained(tmp_path / "saved")
    paths = [str(_png(tmp_path / f"{k}.png", raw[k])) for k in range(N)]
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(tmp_path / "saved"), "--json", *paths]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["class"] for r in rows] == p.classes.tolist() and [r["image"] for r in rows] == paths
    close(torch.tensor([r["lengths"] for r in rows]), p.lengths)
    close(capsnet.predict(model, paths).lengths, p.lengths)  # the files from Python: the same conversion
    Image = pytest.importorskip("PIL.Image")
    close(capsnet.predict(model, [Image.open(path) for path in paths]).lengths, p.lengths)  # PIL images: the same
    # the exported graph takes the same uint8 pixels (checked here on CapsNet with this recipe; test_export checks
    # every model's graph against capsnet.predict on uint8 images)
    if name != "capsnet":
        return
    onnxruntime = pytest.importorskip("onnxruntime")
    capsnet.export_model(model, tmp_path / "model.onnx", check=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    close(torch.from_numpy(session.run(None, {"images": raw.numpy()})[0]), p.lengths)


@pytest.mark.parametrize("name", ["capsnet", "baseline"])
def test_forward_refuses_raw_pixels_in_one_line_naming_the_front_door(name):
    model, raw, _ = _model(name)
    for images in (raw, raw.long()):
        with pytest.raises(TypeError) as e:
            model(images)
        line = str(e.value)
        assert "\n" not in line and "capsnet.preprocess(model, images)" in line and "capsnet.predict" in line
    ensemble = capsnet.Ensemble([model])
    with pytest.raises(TypeError, match=r"capsnet.preprocess\(ensemble, images\)"):
        ensemble(raw)
    with pytest.raises(TypeError, match="one prepared input per member"):
        ensemble(raw.float())  # a single model's batch, not one per member


def test_preprocess_refuses_floats_of_pixel_values_in_one_line():
    model, raw, _ = _model("capsnet", "identity")
    with pytest.raises(DatasetError, match=r"x01 = p / 255 in \[0, 1\], got values in \[0, 255\]; pass the uint8"):
        capsnet.preprocess(model, raw.float())
    with pytest.raises(DatasetError, match=r"images of torch\.int64"):
        capsnet.preprocess(model, raw.long())
    one = capsnet.preprocess(model, raw[0])  # one image [C, H, W]: a batch of one
    close(one, capsnet.preprocess(model, raw)[:1])


def test_evaluate_scores_a_split_a_dataset_and_batches_alike():
    model, raw, labels = _model("capsnet", "identity")
    split = capsnet.evaluate(model, Split(raw, labels), batch_size=4)
    dataset = capsnet.evaluate(model, torch.utils.data.TensorDataset(raw, labels), batch_size=4)
    batches = capsnet.evaluate(model, [(raw[:4], labels[:4]), (raw[4:], labels[4:])])
    predicted = capsnet.predict(model, raw).classes
    accuracy = (predicted == labels).float().mean().item()
    for scores in (split, dataset, batches):
        assert scores["n"] == N and scores["accuracy"] == pytest.approx(accuracy)
        confusion = torch.tensor(scores["confusion"])
        assert confusion.sum() == N and all(confusion[y, k] >= 1 for y, k in zip(labels.tolist(), predicted.tolist()))
        assert scores["loss"] == pytest.approx(split["loss"], rel=1e-5)
