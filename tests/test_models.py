import json

import pytest
import torch

from capsnet import CapsNet, CapsNetConfig, CapsuleDecoder, CheckpointError, ConfigError, load_pretrained
from capsnet.nn.primary import conv_output_size


def test_parameter_counts_match_paper():
    assert sum(p.numel() for p in CapsNet().parameters()) == 8_215_568
    assert sum(p.numel() for p in CapsNet(decoder=False).parameters()) == 6_804_224


def test_forward_output_shapes_and_probabilities():
    model = CapsNet()
    out = model(torch.rand(3, 1, 28, 28), torch.tensor([1, 2, 3]))
    assert out.capsules.shape == (3, 10, 16)
    assert out.lengths.shape == (3, 10)
    assert ((out.lengths >= 0) & (out.lengths < 1)).all()
    assert torch.equal(out.predictions, out.lengths.argmax(1))
    assert out.reconstructions.shape == (3, 1, 28, 28)
    assert out.coupling is None
    out = model(torch.rand(2, 1, 28, 28), return_coupling=True)
    assert out.coupling.shape == (2, 1152, 10)


def test_every_parameter_gets_a_finite_gradient():
    model = CapsNet()
    x = torch.rand(4, 1, 28, 28)
    y = torch.tensor([0, 1, 2, 3])
    out = model(x, y)
    loss, parts = model.loss(out, x, y)
    loss.backward()
    assert set(parts) == {"margin", "reconstruction", "total"}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad and v.dim() == 0 for v in parts.values())
    assert torch.equal(parts["total"], loss.detach())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def _decoder_input(model, x, labels):
    seen = {}

    def hook(module, inputs, output):
        seen["x"] = inputs[0].detach()

    handle = model.decoder.net[0].register_forward_hook(hook)
    model(x, labels)
    handle.remove()
    return seen["x"].view(x.shape[0], 10, 16)


def test_decoder_masked_by_true_label_in_training_and_prediction_at_test():
    model = CapsNet()
    x = torch.rand(2, 1, 28, 28)
    out = model.eval()(x)
    wrong = (out.predictions + 1) % 10
    model.train()
    masked = _decoder_input(model, x, wrong)
    nonzero = masked.abs().sum(-1) > 0
    assert torch.equal(nonzero.float().argmax(1), wrong) and nonzero.sum() == 2
    model.eval()
    masked = _decoder_input(model, x, wrong)
    assert torch.equal((masked.abs().sum(-1) > 0).float().argmax(1), out.predictions)
    # the named deviation: mask by the prediction in training too
    model = CapsNet(decoder_mask="prediction").train()
    pred = model.eval()(x).predictions
    model.train()
    masked = _decoder_input(model, x, (pred + 1) % 10)
    assert torch.equal((masked.abs().sum(-1) > 0).float().argmax(1), pred)


def test_decoder_shape_and_sigmoid_range():
    dec = CapsuleDecoder()
    img = dec(torch.randn(5, 10, 16), torch.tensor([0, 1, 2, 3, 4]))
    assert img.shape == (5, 1, 28, 28)
    assert ((img > 0) & (img < 1)).all()
    assert [m.out_features for m in dec.net if isinstance(m, torch.nn.Linear)] == [512, 1024, 784]


def test_reconstruction_reduction_option():
    x = torch.rand(2, 1, 28, 28)
    y = torch.tensor([0, 1])
    torch.manual_seed(0)
    paper = CapsNet()
    torch.manual_seed(0)
    mean = CapsNet(recon_reduction="mean")
    _, p = paper.loss(paper(x, y), x, y)
    _, m = mean.loss(mean(x, y), x, y)
    assert p["reconstruction"].item() == pytest.approx(784 * m["reconstruction"].item(), rel=1e-5)


def test_bad_images_and_config():
    with pytest.raises(ValueError, match=r"\[B, 1, 28, 28\]"):
        CapsNet(decoder=False)(torch.rand(2, 28, 28))
    with pytest.raises(ConfigError):
        CapsNet(image_size=10)
    with pytest.raises(TypeError):
        CapsNet(not_an_option=1)


def test_other_input_sizes():
    model = CapsNet(in_channels=3, image_size=32, routing_iterations=1, n_classes=5)
    assert model.config.n_primary == 32 * 8 * 8
    out = model(torch.rand(2, 3, 32, 32))
    assert out.reconstructions.shape == (2, 3, 32, 32)


def test_save_load_round_trip(tmp_path):
    model = CapsNet(routing_iterations=2).eval()
    x = torch.rand(3, 1, 28, 28)
    expected = model(x)
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["model_type"] == "capsnet" and meta["config"]["routing_iterations"] == 2
    loaded = CapsNet.from_pretrained(tmp_path / "m")
    assert not loaded.training
    assert loaded.config == model.config
    got = loaded(x)
    assert torch.equal(got.capsules, expected.capsules)
    assert torch.equal(got.reconstructions, expected.reconstructions)
    assert isinstance(load_pretrained(tmp_path / "m"), CapsNet)


def test_pickled_weights_are_refused(tmp_path):
    model = CapsNet(decoder=False)
    model.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "model.safetensors")  # a pickle in disguise
    with pytest.raises(CheckpointError, match="safetensors"):
        CapsNet.from_pretrained(tmp_path)


def test_loading_is_strict(tmp_path):
    CapsNet(decoder=False).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["decoder"] = True
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not match"):
        CapsNet.from_pretrained(tmp_path)
    meta["config"]["unknown_option"] = 1
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="unknown_option"):
        CapsNet.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError):
        CapsNet.from_pretrained(tmp_path / "missing")


def test_config_round_trips_as_plain_dict():
    from capsnet.config import from_dict, to_dict

    cfg = CapsNetConfig(decoder_hidden=(64, 32), router_init_std=0.1)
    assert from_dict(CapsNetConfig, to_dict(cfg)) == cfg
    with pytest.raises(ConfigError):
        from_dict(CapsNetConfig, {"routing_iterations": "three"})


@pytest.mark.parametrize(("image_size", "kernel_size"), [(28, 9), (32, 9), (40, 9), (36, 5), (17, 9)])
def test_primary_grid_is_the_primary_layers_output_grid(image_size, kernel_size):
    cfg = CapsNetConfig(
        image_size=image_size,
        kernel_size=kernel_size,
        conv_channels=8,
        primary_types=2,
        routing_iterations=1,
        decoder=False,
    )
    model = CapsNet(config=cfg)
    side = conv_output_size(image_size, kernel_size)  # after conv1
    assert side == model.conv1(torch.zeros(1, 1, image_size, image_size)).shape[-1]
    assert model.primary.output_grid(side, side) == (cfg.primary_grid, cfg.primary_grid)
    u = model.primary(torch.zeros(1, 8, side, side))
    assert u.shape[1] == cfg.n_primary == 2 * cfg.primary_grid**2


def test_too_small_images_are_a_config_error():
    assert CapsNetConfig(image_size=17).primary_grid == 1  # 17 → 9 → 1
    with pytest.raises(ConfigError, match="too small"):
        CapsNetConfig(image_size=16)  # 16 → 8 → none
