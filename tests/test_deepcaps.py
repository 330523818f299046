"""DeepCaps: its layers against a float64 transcription of the authors' Keras layers (tests/deepcaps_reference.py),
the parameter count of their 28×28 network, the recipe, the decoder, save/load and bad options."""

import json

import numpy as np
import pytest
import torch
from deepcaps_reference import class_capsules, conv2d_caps, conv_caps_3d

from capsnet import load_pretrained
from capsnet.errors import ConfigError
from capsnet.models.deepcaps import DeepCaps, DeepCapsConfig
from capsnet.routing.deepcaps import ConvCaps2D, ConvCaps3D, same_padding
from capsnet.routing.dynamic import Router
from capsnet.training.config import TrainConfig

TINY = {"conv_channels": 8, "cell_types": (4, 4, 4, 4), "cell_dims": (2, 4, 4, 4), "class_dim": 8,
        "decoder_channels": (8, 4, 4)}  # fmt: skip


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


@pytest.mark.parametrize(("size", "stride"), [(7, 2), (8, 2), (5, 1)])
def test_conv_caps_2d_is_the_authors_conv2dcaps(size, stride):
    """Their Conv2DCaps: a "same" convolution of the T·D channels (odd padding pixel at the bottom/right), no bias,
    the squash with Keras's ε in the root. Their kernel [k, k, T_in, D_in, T_out, D_out] is capsnet's
    [T_out·D_out, T_in·D_in, k, k] transposed."""
    torch.manual_seed(0)
    layer = ConvCaps2D(3, 2, 4, 3, stride=stride).double()
    x = torch.randn(2, 3, 2, size, size, dtype=torch.float64)  # [B, T, D, H, W]
    kernel = _np(layer.weight).transpose(2, 3, 1, 0).reshape(3, 3, 3, 2, 4, 3)
    got = layer(x)
    for b in range(2):
        want = conv2d_caps(_np(x[b]).transpose(2, 3, 0, 1), kernel, stride)  # [H', W', T, D]
        np.testing.assert_allclose(_np(got[b]).transpose(2, 3, 0, 1), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("released", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_caps_3d_is_the_authors_3d_routing(released, stride):
    """ConvCapsuleLayer3D: votes by one kernel shared by the input types, the softmax over (T_out, H', W'), the
    squash over each type's D × H' × W' block, the bias; `input_layout="released"` is their reshape of the input."""
    torch.manual_seed(1)
    layout = "released" if released else "capsules"
    layer = ConvCaps3D(3, 2, 4, 3, stride=stride, iterations=3, input_layout=layout).double()
    with torch.no_grad():
        layer.bias.normal_(0, 0.3)
    x = torch.randn(2, 3, 2, 5, 5, dtype=torch.float64)
    w3 = _np(layer.weight).transpose(1, 2, 3, 0)[:, :, :, None, :]  # [D_in, k, k, 1, T_out·D_out]
    got = layer(x)
    for b in range(2):
        want = conv_caps_3d(_np(x[b]).transpose(2, 3, 0, 1), w3, _np(layer.bias), stride, 3, released=released)
        np.testing.assert_allclose(_np(got[b]).transpose(2, 3, 0, 1), want, rtol=1e-10, atol=1e-12)
    if released:  # the two layouts differ: theirs mixes positions into the capsules
        other = ConvCaps3D(3, 2, 4, 3, stride=stride).double()
        other.load_state_dict(layer.state_dict())
        assert (other(x) - got).abs().max() > 1e-3


def test_class_capsules_are_the_authors_capsulelayer():
    """CapsuleLayer: û = W u with their W [J, I, D, d] (capsnet's Router holds it as [I, J, d, D]), a bias added
    before the squash in every iteration, the softmax over the classes; the same up to the Router's 1e-8 in the
    squash."""
    torch.manual_seed(2)
    router = Router(12, 3, 4, 5, 3, bias=True, fast=False).double()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.bias.normal_(0, 0.3)
    u = torch.randn(2, 12, 4, dtype=torch.float64)
    w = _np(router.weight).transpose(1, 0, 3, 2)
    got = router(u)
    for b in range(2):
        np.testing.assert_allclose(_np(got[b]), class_capsules(_np(u[b]), w, _np(router.bias), 3), atol=1e-8)


def test_same_padding_puts_the_odd_pixel_after():
    x = torch.ones(1, 1, 28, 28)
    padded = same_padding(x, 3, 2)  # 28 → 14 needs (13·2 + 3) − 28 = 1 pixel: bottom and right
    assert padded.shape[-2:] == (29, 29) and padded[0, 0, 0, 0] == 1 and padded[0, 0, -1, -1] == 0
    assert same_padding(torch.ones(1, 1, 7, 7), 3, 2).shape[-2:] == (9, 9)  # 7 → 4: one on each side


def test_the_authors_28x28_network_has_8441920_parameters_and_the_decoder_58417():
    """The arithmetic of the module docstring (capsnet.models.deepcaps), layer by layer, on DeepCapsNet28."""
    model = DeepCaps()
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model.decoder) == 58_417
    assert count(model) - count(model.decoder) == 8_441_920
    assert [count(cell) for cell in model.cells] == [589_824, 2_064_384, 2_359_296, 1_788_160]
    assert model.config.grids() == [14, 7, 4, 2] and model.config.n_class_inputs == 640
    assert count(model.class_caps) == 1_638_720


def test_forward_fields_decoder_mask_and_loss():
    torch.manual_seed(3)
    model = DeepCaps(**TINY).train()
    x, y = torch.rand(3, 1, 28, 28), torch.tensor([1, 5, 9])
    out = model(x, y, return_coupling=True)
    assert out.capsules.shape == (3, 10, 8) and out.reconstructions.shape == (3, 1, 28, 28)
    assert out.coupling.shape == (3, 2 * 2 * 4 + 4 * 4 * 4, 10)
    torch.testing.assert_close(out.coupling.sum(-1), torch.ones(3, 80))
    assert (out.reconstructions >= 0).all()  # the closing ReLU
    # class-independent: the decoder sees only the chosen capsule, so changing another class's leaves it alone
    model.eval()
    out = model(x)
    others = out.capsules.clone()
    mask = torch.ones_like(others, dtype=torch.bool)
    mask[torch.arange(3), out.predictions] = False
    others[mask] = 7.0
    torch.testing.assert_close(model.decoder(others, out.predictions), out.reconstructions)
    total, parts = model.loss(out, x, y)
    margin = model.margin_loss(out.lengths, y)
    torch.testing.assert_close(total, margin + 0.4 * (out.reconstructions - x).pow(2).mean())
    assert set(parts) == {"margin", "reconstruction", "total"}


def test_recipe_is_the_authors_train_py():
    """Adam 1e-3, ×0.5 every 10 epochs (here per epoch, 0.5^0.1), batch 256, Keras's ImageDataGenerator ranges."""
    assert DeepCaps.default_lr == 1e-3 and DeepCaps.default_batch_size == 256
    assert DeepCaps.default_lr_decay == pytest.approx(0.933033, abs=1e-6)
    assert TrainConfig(model="deepcaps").decay_per_epoch == DeepCaps.default_lr_decay
    assert DeepCaps.data_recipes["idx"]["augment"] == "shift=3,rotate=0.1,zoom=0.9:1.1"  # (flips: not on digits)
    cfg = DeepCapsConfig()
    assert (cfg.recon_weight, cfg.class_dim, cfg.routing_iterations, cfg.conv3d_input) == (0.4, 32, 3, "capsules")


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(4)
    model = DeepCaps(**TINY, conv3d_input="released").eval()
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "deepcaps"
    loaded = load_pretrained(tmp_path / "m")
    assert type(loaded) is DeepCaps and loaded.config == model.config
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(model(x).lengths, loaded(x).lengths)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cell_types": (4,), "cell_dims": (4,)}, "at least 2 cells"),
        ({"cell_types": (4, 4), "cell_dims": (4,)}, "one positive entry per cell"),
        ({"image_size": 30}, "multiple of"),
        ({"conv3d_input": "nchw"}, "conv3d_input"),
        ({"recon_weight": -1.0}, "recon_weight"),
        ({"n_classes": 1}, "n_classes"),
    ],
)
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        DeepCapsConfig(**options)


def test_wrong_images_are_refused():
    with pytest.raises(ValueError, match=r"\[B, 1, 28, 28\]"):
        DeepCaps(**TINY)(torch.rand(1, 1, 32, 32))


def test_conv_caps_2d_starts_as_keras_2_glorot_on_a_rank_6_kernel():
    """Keras 2 gives a kernel of rank 6 fan_in = fan_out = √N: for (3, 3, 128, 1, 32, 4), N = 147,456, √N = 384,
    bound √(6 / 768) = 0.08839. (The convolution fans, 32·1152 and 4·1152, would give 0.01203: at that scale the
    squashes shrink the capsules to 0 in float32 by the third cell.)"""
    torch.manual_seed(5)
    w = ConvCaps2D(128, 1, 32, 4).weight
    assert 0.0880 < w.abs().max().item() <= 0.08839
    torch.manual_seed(5)
    outs = DeepCaps().eval().encode(torch.rand(2, 1, 28, 28))
    assert all(o.norm(dim=2).mean() > 1e-2 for o in outs)
