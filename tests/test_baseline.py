import pytest
import torch

from capsnet import load_pretrained
from capsnet.data import Split, load_dataset
from capsnet.errors import ConfigError
from capsnet.models.baseline import BaselineCNN, BaselineConfig, count_parameters
from capsnet.training.api import train
from capsnet.training.config import TrainConfig
from capsnet.training.evaluator import evaluate

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
    assert torch.equal(parts["total"], loss.detach()) and not parts["total"].requires_grad
    assert model.classifier.weight.grad is not None
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


def test_evaluate_counts_the_baselines_own_predictions():
    test = load_dataset("mnist-sample").test
    x, y = test.images[:120].float() / 255, test.labels[:120]
    torch.manual_seed(3)
    model = BaselineCNN(**TINY).eval()
    with torch.no_grad():
        out = model(x)
        expected_loss = model.loss(out, x, y)[0].item()
    r = evaluate(model, Split(test.images[:120], y), batch_size=50, device="cpu")  # 50 + 50 + 20: batches add up
    assert r["n"] == 120
    assert r["accuracy"] == pytest.approx((out.predictions == y).float().mean().item())
    assert r["loss"] == pytest.approx(expected_loss, rel=1e-5)
    confusion = torch.tensor(r["confusion"])
    assert torch.equal(confusion.sum(1), torch.bincount(y, minlength=10))
    assert torch.equal(confusion.sum(0), torch.bincount(out.predictions, minlength=10))


@pytest.mark.slow
def test_train_with_the_baseline(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"), model="baseline", train_subset=64, test_subset=32, batch_size=32,
                      epochs=1, progress=False, tensorboard=False)  # fmt: skip
    result = train(cfg, BaselineConfig(**TINY))
    assert result.epochs_done == 1
    assert result.history[0]["lr"] == BaselineCNN.default_lr  # no --lr: the baseline's own default
    last = load_pretrained(tmp_path / "run" / "last")
    assert isinstance(last, BaselineCNN) and last.config.channels == TINY["channels"]
    test = load_dataset("mnist-sample").test
    again = evaluate(last, Split(test.images[:32], test.labels[:32]))
    assert again["accuracy"] == pytest.approx(result.test["last"]["accuracy"])  # the figure is the saved model's
    assert again["loss"] == pytest.approx(result.test["last"]["loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="BaselineConfig"):
        from helpers import small_config

        train(TrainConfig(out=str(tmp_path / "r2"), model="baseline", train_subset=32, progress=False), small_config())


@pytest.mark.slow
def test_the_baseline_learns_with_its_default_lr(tmp_path):
    """A narrow baseline (with pooling, so it is quick) on 1,024 digits (no validation split: the learning rate is
    the question, not the checkpoint), 3 epochs at its default lr (1e-4): test accuracy well above chance on 500 test
    digits (0.234 measured; chance is 0.10, one standard error 0.013)."""
    sizes = dict(train_subset=1024, test_subset=500, batch_size=16, epochs=3, val_fraction=0.0)
    cfg = TrainConfig(out=str(tmp_path / "run"), model="baseline", progress=False, tensorboard=False, **sizes)
    result = train(cfg, BaselineConfig(channels=(32, 32, 16), hidden=(64, 32), pool=True))
    losses = [row["train_loss"] for row in result.history]
    assert losses[2] < losses[1] < losses[0]
    assert result.test["last"]["accuracy"] > 0.17
