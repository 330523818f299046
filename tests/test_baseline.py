import pytest
import torch

from capsnet import load_pretrained
from capsnet.data import load_dataset
from capsnet.errors import ConfigError
from capsnet.models.baseline import BaselineCNN, BaselineConfig, count_parameters
from capsnet.training.evaluate import evaluate
from capsnet.training.loop import TrainConfig, train

TINY = dict(channels=(8, 8, 4), hidden=(32, 16))


def test_parameter_count_matches_the_paper():
    # Paper (§5): 35.4M parameters for the MNIST baseline; "same" padding, no pooling gives exactly that.
    assert count_parameters(BaselineCNN()) == 35_445_522
    assert count_parameters(BaselineCNN(padding="valid")) == 13_277_970
    assert count_parameters(BaselineCNN(pool=True)) == 2_907_922


def test_forward_backward_and_output_fields():
    model = BaselineCNN(**TINY)
    x, y = torch.rand(5, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4])
    out = model(x, y)
    assert out.lengths.shape == (5, 10) and torch.allclose(out.lengths.sum(1), torch.ones(5))
    assert out.predictions.shape == (5,) and out.reconstructions is None and out.capsules is None
    assert out.coupling is None
    loss, parts = model.loss(out, x, y)
    loss.backward()
    assert parts["total"] == pytest.approx(loss.item()) and model.classifier.weight.grad is not None
    with pytest.raises(ValueError, match="expects images"):
        model(torch.rand(2, 1, 20, 20))


def test_multi_hot_loss_is_cross_entropy_against_half_half():
    model = BaselineCNN(**TINY).eval()
    out = model(torch.rand(3, 1, 28, 28))
    targets = torch.zeros(3, 10)
    targets[:, 2] = targets[:, 7] = 1
    loss, _ = model.loss(out, None, targets)
    logp = out.logits.log_softmax(1)
    assert loss.item() == pytest.approx((-(logp[:, 2] + logp[:, 7]) / 2).mean().item(), rel=1e-5)


def test_config_validation_and_pretrained_roundtrip(tmp_path):
    with pytest.raises(ConfigError):
        BaselineConfig(dropout=1.0)
    with pytest.raises(ConfigError):
        BaselineConfig(image_size=2, padding="valid")
    model = BaselineCNN(config=BaselineConfig(image_size=36, **TINY))
    model.save_pretrained(tmp_path / "m")
    again = load_pretrained(tmp_path / "m")
    assert isinstance(again, BaselineCNN) and again.config == model.config


def test_evaluate_and_train_with_the_baseline(tmp_path):
    data = load_dataset("mnist-sample")
    model = BaselineCNN(**TINY)
    r = evaluate(model, data.test, batch_size=100, device="cpu")
    assert r["n"] == len(data.test) and 0 <= r["accuracy"] <= 1
    cfg = TrainConfig(out=str(tmp_path / "run"), model="baseline", train_subset=64, test_subset=32, batch_size=32,
                      epochs=1, progress=False, tensorboard=False)  # fmt: skip
    result = train(cfg, BaselineConfig(**TINY))
    assert result.epochs_done == 1
    assert result.history[0]["lr"] == BaselineCNN.default_lr  # no --lr: the baseline's own default
    assert isinstance(load_pretrained(tmp_path / "run" / "last"), BaselineCNN)
    with pytest.raises(ConfigError, match="BaselineConfig"):
        from helpers import small_config

        train(TrainConfig(out=str(tmp_path / "r2"), model="baseline", train_subset=32, progress=False), small_config())
