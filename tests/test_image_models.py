"""Models that take what the data has: channels, H×W, any number of classes; leaky routing and the capsule bias
against literal references; the image augmentations; a short training run on a 3-channel non-square set."""

from __future__ import annotations

import json

import pytest
import torch

from capsnet import CapsNet, CapsNetConfig
from capsnet.config import from_dict
from capsnet.data import standins
from capsnet.data.imageaug import (
    DEFAULTS,
    AugmentSpec,
    center_crop,
    random_brightness,
    random_colour,
    random_contrast,
    random_crop,
    random_flip,
    random_rotate_zoom,
    resolve_augment,
)
from capsnet.errors import ConfigError
from capsnet.models.baseline import BaselineCNN
from capsnet.nn.squash import squash
from capsnet.nn.standardize import per_image_standardize
from capsnet.routing.dynamic import Router, dynamic_routing, leaky_softmax

SMALL = dict(conv_channels=8, kernel_size=5, primary_types=2, primary_dim=4, class_dim=6, decoder_hidden=(16,))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSNET_DATA", str(tmp_path / "cache"))


# ------------------------------------------------------------------------------------------------ routing options
def literal_routing(u_hat, iterations, *, leaky=False, bias=None):
    """Procedure 1 with Python loops over the batch, inputs and outputs; leaky: an extra zero logit per input
    capsule in the softmax over the outputs, its share dropped (§7); bias [out, d] added to s_j."""
    batch, n_in, n_out, _ = u_hat.shape
    vs = []
    for b_ in range(batch):
        logits = [[torch.zeros(()) for _ in range(n_out)] for _ in range(n_in)]
        for r in range(iterations):
            c = []
            for i in range(n_in):
                exps = [torch.exp(logits[i][j]) for j in range(n_out)]
                z = sum(exps) + (1.0 if leaky else 0.0)  # the leaky logit 0 contributes exp(0) = 1
                c.append([e / z for e in exps])
            v = []
            for j in range(n_out):
                s = sum(c[i][j] * u_hat[b_, i, j] for i in range(n_in))
                if bias is not None:
                    s = s + bias[j]
                v.append(squash(s))
            if r < iterations - 1:
                for i in range(n_in):
                    for j in range(n_out):
                        logits[i][j] = logits[i][j] + (u_hat[b_, i, j] * v[j]).sum()
        vs.append(torch.stack(v))
    return torch.stack(vs)


@pytest.mark.parametrize("leaky,use_bias", [(True, False), (False, True), (True, True)])
def test_leaky_routing_and_bias_match_the_literal_reference(leaky, use_bias):
    torch.manual_seed(0)
    router = Router(5, 3, 4, 6, 3, leaky=leaky, bias=use_bias)
    if use_bias:
        torch.nn.init.normal_(router.bias, std=0.3)
    u = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    router = router.double()
    v = router(u)
    ref = literal_routing(router.votes(u), 3, leaky=leaky, bias=router.bias)
    torch.testing.assert_close(v, ref)
    g = torch.randn_like(v)
    grads = torch.autograd.grad((v * g).sum(), [u, router.weight, *([router.bias] if use_bias else [])])
    ref_grads = torch.autograd.grad((ref * g).sum(), [u, router.weight, *([router.bias] if use_bias else [])])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
        assert a.abs().sum() > 0 and torch.isfinite(a).all()


def test_leaky_softmax_is_the_softmax_with_a_dropped_zero_logit():
    b = torch.randn(3, 7, 4)
    c = leaky_softmax(b)
    ref = torch.exp(b) / (1 + torch.exp(b).sum(-1, keepdim=True))
    torch.testing.assert_close(c, ref)
    assert (c.sum(-1) < 1).all()
    _, c_final = dynamic_routing(torch.randn(2, 7, 4, 5), 1, leaky=True)
    torch.testing.assert_close(c_final, torch.full((2, 7, 4), 1 / 5))  # first pass: 1/(out + 1) each


def test_fast_router_with_leaky_routing_matches_the_literal_reference():
    torch.manual_seed(1)
    router = Router(6, 3, 4, 5, 3, leaky=True, fast=True)
    u = torch.randn(3, 6, 4)
    ref = literal_routing(router.votes(u).double(), 3, leaky=True).float()
    torch.testing.assert_close(router(u), ref, rtol=1e-4, atol=1e-5)
    assert "leaky=True" in repr(router)


# ------------------------------------------------------------------------------------------------ models
def test_capsnet_takes_channels_non_square_sizes_and_classes():
    cfg = CapsNetConfig(in_channels=3, image_size=(20, 28), n_classes=4, padding="same", conv1_stride=2,
                        leaky_routing=True, capsule_bias=True, **SMALL)  # fmt: skip
    # same padding: 20x28 -> conv 5 stride 2 -> 10x14 -> conv 5 stride 2 -> 5x7
    assert cfg.primary_hw == (5, 7) and cfg.n_primary == 2 * 5 * 7
    model = CapsNet(config=cfg)
    x = torch.rand(2, 3, 20, 28)
    out = model.train()(x, torch.tensor([0, 3]))
    assert out.lengths.shape == (2, 4) and out.reconstructions.shape == (2, 3, 20, 28)
    loss, _ = model.loss(out, x, torch.tensor([0, 3]))
    loss.backward()
    assert model.class_caps.bias.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"\[B, 3, 20, 28\]"):
        model(torch.rand(2, 3, 28, 20))
    valid = CapsNetConfig(in_channels=2, image_size=32, n_classes=5, **SMALL)  # 32 -> 28 -> 12
    assert valid.primary_hw == (12, 12) and CapsNet(
        config=valid,
    ).decoder.out_shape == (2, 32, 32)
    assert CapsNet(config=CapsNetConfig(decoder=False, **SMALL)).decoder is None


def test_bad_model_configs_are_one_line_errors():
    with pytest.raises(ConfigError, match="n_classes must be >= 2"):
        CapsNetConfig(n_classes=1)
    with pytest.raises(ConfigError, match="images of 8x8 are too small for two 9x9 valid convolutions"):
        CapsNetConfig(image_size=8)
    with pytest.raises(ConfigError, match="options of dynamic routing"):
        CapsNetConfig(leaky_routing=True, routing="self-attention")
    with pytest.raises(ConfigError, match="n_classes must be >= 2"):
        from capsnet.models.baseline import BaselineConfig

        BaselineConfig(n_classes=1)


def test_old_configs_still_load():
    old = {"in_channels": 1, "image_size": 28, "n_classes": 10, "conv_channels": 256, "kernel_size": 9}
    cfg = from_dict(CapsNetConfig, old)
    assert cfg.image_size == 28 and cfg.padding == "valid" and not cfg.leaky_routing
    assert from_dict(CapsNetConfig, {**CapsNet.saved_defaults, **old}).digits  # a saved folder of then: digits
    assert from_dict(CapsNetConfig, {"image_size": [24, 32]}).image_size == (24, 32)
    with pytest.raises(ConfigError):
        from_dict(CapsNetConfig, {"image_size": "big"})
    assert sum(p.numel() for p in CapsNet().parameters()) == 8_215_568  # the paper's model is unchanged


def test_baseline_non_square_and_standardized():
    model = BaselineCNN(in_channels=3, image_size=(12, 20), n_classes=3, channels=(4, 4), hidden=(8,),
                        standardize=True)  # fmt: skip
    out = model(torch.rand(2, 3, 12, 20))
    assert out.lengths.shape == (2, 3)
    a = model.eval()(torch.rand(1, 3, 12, 20) * 0.1)
    assert torch.isfinite(a.logits).all()


def test_per_image_standardize():
    x = torch.rand(3, 3, 8, 9) * 5 + 2
    y = per_image_standardize(x)
    torch.testing.assert_close(y.flatten(1).mean(1), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.flatten(1).std(1, unbiased=False), torch.ones(3), atol=1e-4, rtol=0)
    assert per_image_standardize(torch.full((1, 1, 4, 4), 0.7)).abs().max() < 1e-5  # uniform: ~0, not NaN


# ------------------------------------------------------------------------------------------------ augmentation
def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_augmentations_shapes_determinism_and_identity():
    x = torch.rand(6, 3, 10, 12)
    crop = random_crop(x, (7, 8), generator=gen())
    assert crop.shape == (6, 3, 7, 8)
    assert torch.equal(crop, random_crop(x, (7, 8), generator=gen()))
    for i in range(6):  # each crop is a window of its own image
        windows = x[i].unfold(1, 7, 1).unfold(2, 8, 1).permute(1, 2, 0, 3, 4)  # [oy, ox, C, 7, 8]
        assert (windows == crop[i]).flatten(2).all(-1).any()
    assert torch.equal(random_crop(x, (10, 12), generator=gen()), x)
    flipped = random_flip(x, generator=gen(3))
    same = [torch.equal(flipped[i], x[i]) for i in range(6)]
    mirrored = [torch.equal(flipped[i], x[i].flip(-1)) for i in range(6)]
    assert all(s or m for s, m in zip(same, mirrored)) and any(mirrored)
    assert torch.equal(random_brightness(x, 0.0, generator=gen()), x)
    assert torch.equal(random_contrast(x, 1.0, 1.0, generator=gen()), x)
    b = random_brightness(x, 0.25, generator=gen())
    delta = (b - x).flatten(1)
    assert (delta.max(1).values - delta.min(1).values).abs().max() < 1e-6 and delta.abs().max() <= 0.25
    c = random_contrast(x, 0.2, 1.8, generator=gen())
    torch.testing.assert_close(c.mean(dim=(2, 3)), x.mean(dim=(2, 3)))  # contrast keeps each channel's mean
    assert torch.equal(center_crop(x, (6, 8)), x[:, :, 2:8, 2:10])
    with pytest.raises(ValueError, match="larger than the images"):
        random_crop(x, (11, 12), generator=gen())


def test_augment_spec_round_trip_defaults_and_identity():
    cifar = DEFAULTS["cifar10"]
    assert str(cifar) == "crop=24x24,flip,brightness=0.247059,contrast=0.2:1.8,standardize"
    assert AugmentSpec.parse(str(cifar)).crop == (24, 24) and AugmentSpec.parse("none") == AugmentSpec()
    assert DEFAULTS["smallnorb"].crop == (32, 32) and DEFAULTS["svhn"].shift == 2 and not DEFAULTS["svhn"].flip
    assert not DEFAULTS["idx"].flip  # never for digits
    assert resolve_augment("auto", "idx", shift=1).shift == 1
    x = torch.rand(4, 3, 32, 32)
    assert torch.equal(AugmentSpec()(x, gen()), x)
    out = cifar(x, gen(5))
    assert out.shape == (4, 3, 24, 24) and torch.equal(out, cifar(x, gen(5))) and 0 <= out.min() <= out.max() <= 1
    with pytest.raises(ConfigError, match="cannot read 'crop=big'"):
        AugmentSpec.parse("crop=big")


def test_rotate_and_zoom_augmentation():
    x = torch.zeros(5, 1, 21, 21)
    x[:, :, 10, 4:17] = 1.0  # a horizontal bar through the centre, 13 px long
    assert torch.equal(random_rotate_zoom(x, 0.0, (1.0, 1.0), generator=gen()), x)
    # zoom only, a fixed factor 2: the bar's centre stays, its length doubles (clipped by the 21 px canvas).
    z = random_rotate_zoom(x, 0.0, (2.0, 2.0), generator=gen())
    assert torch.allclose(z[:, 0, 10], torch.ones(5, 21)) and z[:, 0, :9].abs().max() < 1e-6
    # rotation only: each image turned by its own angle in [-90, 90]; the bar keeps its length (its mass, up to
    # bilinear sampling), passes through the centre, and the result is reproducible with the same generator.
    r = random_rotate_zoom(x, 90.0, (1.0, 1.0), generator=gen(7))
    assert torch.equal(r, random_rotate_zoom(x, 90.0, (1.0, 1.0), generator=gen(7)))
    assert torch.allclose(r.sum(dim=(1, 2, 3)), x.sum(dim=(1, 2, 3)), rtol=0.1)
    assert (r[:, 0, 10, 10] > 0.99).all() and not torch.allclose(r, x, atol=1e-3)
    spec = AugmentSpec.parse("rotate=15,zoom=0.9:1.1,shift=2")
    assert (spec.rotate, spec.zoom, spec.shift) == (15.0, (0.9, 1.1), 2) and AugmentSpec.parse(str(spec)) == spec
    zero = AugmentSpec.parse("shift=2,zero-fill")
    assert zero.zero_fill and not spec.zero_fill and AugmentSpec.parse(str(zero)) == zero
    out = spec(torch.rand(4, 1, 28, 28), gen(2))
    assert out.shape == (4, 1, 28, 28) and 0 <= out.min() <= out.max() <= 1
    for bad in ("rotate=-5", "zoom=1.2:1.1", "zoom=0:1", "rotate=x"):
        with pytest.raises(ConfigError):
            AugmentSpec.parse(bad)


def test_colour_augmentation_permutes_each_images_channels_and_inverts_about_half():
    x = torch.rand(64, 3, 5, 6)
    out = random_colour(x, generator=gen(4))
    assert torch.equal(out, random_colour(x, generator=gen(4))) and out.shape == x.shape
    orders, inverted = set(), 0
    for i in range(64):  # each image is its own channels in some order, or their inverses (1 - x)
        flag = int(not any(torch.equal(out[i, 0], x[i, c]) for c in range(3)))
        image = 1 - out[i] if flag else out[i]
        order = tuple(next(c for c in range(3) if torch.equal(image[k], x[i, c])) for k in range(3))
        assert sorted(order) == [0, 1, 2], (i, order)
        orders.add(order)
        inverted += flag
    assert len(orders) == 6  # all six orders of three channels among 64 images
    assert 16 <= inverted <= 48  # about half: Binomial(64, 1/2) is 32 ± 4
    spec = AugmentSpec.parse("shift=2,colour")
    assert spec.colour and str(spec) == "shift=2,colour" and AugmentSpec.parse(str(spec)) == spec
    with pytest.raises(ConfigError, match="colour"):
        AugmentSpec(colour=True, channel_standardize=True)


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_two_step_training_of_a_three_channel_non_square_model(tmp_path):
    from capsnet.inference import evaluate_checkpoint
    from capsnet.models.pretrained import load_pretrained
    from capsnet.training.api import train
    from capsnet.training.config import TrainConfig

    data = standins.write_npz(tmp_path / "rgb.npz", n_train=8, n_test=6, n_classes=3, shape=(20, 28, 3))
    config = TrainConfig(dataset=str(data), epochs=1, batch_size=4, device="cpu", out=str(tmp_path / "run"),
                         progress=False, tensorboard=False)  # fmt: skip
    result = train(config, CapsNetConfig(padding="same", leaky_routing=True, **SMALL))
    assert result.epochs_done == 1 and len(result.history) == 1
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["model"]["image_size"] == [20, 28] and meta["model"]["in_channels"] == 3
    assert meta["model"]["n_classes"] == 3 and meta["augment"] == "shift=2" and not meta["model"]["digits"]
    model = load_pretrained(tmp_path / "run" / "last")
    assert model.config.image_size == (20, 28)
    assert evaluate_checkpoint(tmp_path / "run", dataset=str(data))["n"] == 6


def test_cifar_stand_in_trains_on_crops_and_tests_on_centre_crops(tmp_path):
    from capsnet.models.pretrained import load_pretrained
    from capsnet.models.recipe import model_input
    from capsnet.training.api import train
    from capsnet.training.config import TrainConfig

    folder = standins.write_cifar(tmp_path / "c10", n_train=10, n_test=8)
    config = TrainConfig(dataset=str(folder), epochs=1, batch_size=5, device="cpu", out=str(tmp_path / "run"),
                         progress=False, tensorboard=False, model="baseline")  # fmt: skip
    from capsnet.models.baseline import BaselineConfig

    result = train(config, BaselineConfig(channels=(4,), hidden=(8,), kernel_size=3))
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["model"]["image_size"] == 24 and meta["model"]["source_size"] == [32, 32]
    assert meta["model"]["standardize"] and meta["model"]["class_names"][0] == "airplane"
    assert meta["augment"].startswith("crop=24x24,flip") and len(result.history) == 1
    # tests on centre crops: the model's input from 32x32 images is their centre 24x24, whatever the border holds
    model = load_pretrained(tmp_path / "run" / "last")
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    border, centre = images.clone(), images.clone()
    border[..., :4, :], border[..., :, 28:] = 255 - border[..., :4, :], 0
    centre[..., 16, 16] = 255 - centre[..., 16, 16]
    seen = model_input(model, images)
    assert seen.shape == (2, 3, 24, 24) and torch.equal(model_input(model, border), seen)
    assert not torch.equal(model_input(model, centre), seen)


@pytest.mark.parametrize("detach_votes", [False, True])
@pytest.mark.parametrize("iterations", [1, 3])
def test_fast_gemm_path_supports_leaky_routing(detach_votes, iterations):
    from capsnet.routing.dynamic import route_votes
    from capsnet.routing.dynamic_fast import fast_dynamic_routing

    torch.manual_seed(2)
    u = torch.randn(5, 7, 4, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(7, 3, 4, 6, dtype=torch.float64) * 0.4).requires_grad_()
    v, c = fast_dynamic_routing(u, w, iterations, detach_votes=detach_votes, chunk=2, leaky=True)
    v_ref, c_ref = dynamic_routing(route_votes(w, u), iterations, detach_votes=detach_votes, leaky=True)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(c, c_ref)
    g, gc = torch.randn_like(v), torch.randn_like(c)
    grads = torch.autograd.grad((v * g).sum() + (c * gc).sum(), [u, w])
    ref = torch.autograd.grad((v_ref * g).sum() + (c_ref * gc).sum(), [u, w])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("leaky", [False, True])
@pytest.mark.parametrize("iterations", [1, 3])
def test_fast_gemm_path_supports_the_capsule_bias(leaky, iterations):
    from capsnet.routing.dynamic import route_votes
    from capsnet.routing.dynamic_fast import fast_dynamic_routing

    torch.manual_seed(3)
    u = torch.randn(5, 7, 4, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(7, 3, 4, 6, dtype=torch.float64) * 0.4).requires_grad_()
    bias = (torch.randn(3, 6, dtype=torch.float64) * 0.3).requires_grad_()
    v, c = fast_dynamic_routing(u, w, iterations, chunk=2, leaky=leaky, bias=bias)
    v_ref, c_ref = dynamic_routing(route_votes(w, u), iterations, leaky=leaky, bias=bias)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(c, c_ref)
    g, gc = torch.randn_like(v), torch.randn_like(c)
    grads = torch.autograd.grad((v * g).sum() + (c * gc).sum(), [u, w, bias])
    ref = torch.autograd.grad((v_ref * g).sum() + (c_ref * gc).sum(), [u, w, bias])
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="reference path"):
        fast_dynamic_routing(u, w, iterations, detach_votes=True, bias=bias)


def test_router_with_bias_and_detach_votes_takes_the_reference_path():
    torch.manual_seed(4)
    router = Router(6, 3, 4, 5, 3, bias=True, detach_votes=True).double()
    torch.nn.init.normal_(router.bias, std=0.3)
    u = torch.randn(2, 6, 4, dtype=torch.float64)
    ref = dynamic_routing(router.votes(u), 3, detach_votes=True, bias=router.bias)[0]
    torch.testing.assert_close(router(u), ref)
