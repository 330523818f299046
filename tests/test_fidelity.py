"""The options and defaults the audit against the authors' code added or changed (docs/fidelity.md), each checked
against a literal transcription of what that code computes, and old config.json files still loading as saved."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_MODEL

from capsnet import CapsNet, ConfigError, Router, load_pretrained
from capsnet.cli import main
from capsnet.data.imageaug import DEFAULTS, AugmentSpec
from capsnet.models.baseline import BaselineCNN, count_parameters
from capsnet.models.capsnet import CapsNetConfig
from capsnet.models.inverted_attention_capsnet import InvertedAttentionCapsNet, InvertedAttentionCapsNetConfig
from capsnet.nn.losses import MarginLoss
from capsnet.nn.primary import PrimaryCapsules
from capsnet.nn.squash import squash
from capsnet.routing.dynamic import BIAS_INIT

SMALL_IA = {"in_channels": 1, "image_size": 28, "stem_channels": 8, "primary_types": 2, "capsule_types": (2, 2)}


# ------------------------------------------------------------------ CapsNet: the official TensorFlow code's options
def test_primary_routing_scales_the_convolution_not_its_bias():
    """research/capsules' conv_slim_capsule with num_routing=1: softmax of zero logits over the 32 types (33 with the
    leak) times the votes, plus the bias, then the squash."""
    torch.manual_seed(0)
    layer = PrimaryCapsules(in_channels=6, n_types=3, capsule_dim=4, kernel_size=3, stride=2, vote_scale=1 / 3)
    x = torch.randn(2, 6, 9, 9)
    votes = F.conv2d(x, layer.conv.weight, stride=2)  # [B, 3·4, 4, 4]
    s = votes / 3 + layer.conv.bias.view(1, -1, 1, 1)
    expected = squash(s.view(2, 3, 4, 4, 4).permute(0, 1, 3, 4, 2).reshape(2, -1, 4))
    torch.testing.assert_close(layer(x), expected)
    assert CapsNet(**SMALL_MODEL, primary_routing=True).primary.vote_scale == 1 / 4
    assert CapsNet(**SMALL_MODEL, primary_routing=True, leaky_routing=True).primary.vote_scale == 1 / 5
    assert CapsNet(**SMALL_MODEL).primary.vote_scale == 1.0  # the paper (the default)


def test_flat_primary_grouping_is_a_view_of_the_nchw_map():
    """XifengGuo/CapsNet-Pytorch: `conv(x).view(B, -1, D)`, capsules of D consecutive values of [types·D, H, W]."""
    torch.manual_seed(1)
    layer = PrimaryCapsules(in_channels=4, n_types=2, capsule_dim=4, kernel_size=3, stride=2, grouping="flat")
    x = torch.randn(3, 4, 9, 9)
    y = layer.conv(x)  # [3, 8, 4, 4]
    flat = y.flatten()
    for b, i in [(0, 0), (1, 5), (2, 31)]:  # capsule i of image b: values 4i..4i+3 of the image's flattened map
        start = b * 128 + 4 * i
        torch.testing.assert_close(layer(x)[b, i], squash(flat[start : start + 4]))
    with pytest.raises(ValueError, match="grouping"):
        PrimaryCapsules(grouping="rows")


def test_router_coupling_over_the_inputs_matches_a_literal_loop():
    """gram-ai/capsule-networks: c_ij = exp(b_ij) / Σ_i' exp(b_i'j), softmax over the input capsules."""
    torch.manual_seed(2)
    router = Router(7, 3, 4, 5, 3, coupling="inputs")
    u = squash(torch.randn(2, 7, 4))
    u_hat = router.votes(u).detach().double()
    v_ref = torch.zeros(2, 3, 5, dtype=torch.float64)
    for n in range(2):
        b = [[0.0] * 3 for _ in range(7)]
        for _r in range(3):
            for j in range(3):
                z = sum(math.exp(b[i][j]) for i in range(7))
                s = sum(math.exp(b[i][j]) / z * u_hat[n, i, j] for i in range(7))
                v_ref[n, j] = squash(s)
            for i in range(7):
                for j in range(3):
                    b[i][j] += float(u_hat[n, i, j] @ v_ref[n, j])
    torch.testing.assert_close(router(u).double(), v_ref, atol=1e-6, rtol=1e-5)
    assert torch.allclose(router.forward(u, return_coupling=True).coupling.sum(dim=1), torch.ones(2, 3))
    with pytest.raises(ValueError, match="coupling"):
        Router(7, 3, 4, 5, coupling="classes")
    with pytest.raises(ValueError, match="leaky"):
        Router(7, 3, 4, 5, coupling="inputs", leaky=True)


def test_capsule_bias_starts_at_the_official_codes_value():
    assert BIAS_INIT == 0.1
    assert torch.equal(Router(7, 3, 4, 5, bias=True).bias, torch.full((3, 5), 0.1))
    assert CapsNet(**SMALL_MODEL, capsule_bias=True).class_caps.bias.eq(0.1).all()


def test_half_mean_margin_loss_is_the_official_codes():
    """research/capsules `_margin_loss`: logits − 0.5 against the margin 0.4 on each side, 0.5 · positive +
    0.5 · 0.5 · negative, then `reduce_mean` over batch and classes."""
    torch.manual_seed(3)
    lengths, labels = torch.rand(6, 10), torch.randint(0, 10, (6,))
    t = F.one_hot(labels, 10).float()
    x = lengths - 0.5
    positive = t * (x < 0.4).float() * (x - 0.4) ** 2
    negative = (1 - t) * (x > -0.4).float() * (x + 0.4) ** 2
    official = (0.5 * positive + 0.5 * 0.5 * negative).mean()
    torch.testing.assert_close(MarginLoss(10, reduction="half-mean")(lengths, labels), official)
    torch.testing.assert_close(MarginLoss(10)(lengths, labels), official * 20)  # Eq. 4 = 2n × theirs
    with pytest.raises(ValueError, match="reduction"):
        MarginLoss(10, reduction="mean")


def test_capsnet_trains_with_the_official_margin_reduction_by_default():
    """The default (measured: docs/benchmarks.md): CapsNet's loss = the official margin loss + 0.0005 × the summed
    squared error averaged over the batch; `margin_reduction="sum"` is Eq. 4 as printed."""
    torch.manual_seed(8)
    model = CapsNet(**SMALL_MODEL).train()
    x, y = torch.rand(4, 1, 28, 28), torch.tensor([0, 3, 5, 9])
    out = model(x, y)
    t = F.one_hot(y, 10).float()
    eq4 = t * F.relu(0.9 - out.lengths) ** 2 + 0.5 * (1 - t) * F.relu(out.lengths - 0.1) ** 2  # [B, 10]
    recon = 0.0005 * (out.reconstructions - x).pow(2).flatten(1).sum(1).mean()
    total, parts = model.loss(out, x, y)
    torch.testing.assert_close(parts["margin"], (0.5 * eq4.mean()).detach())
    torch.testing.assert_close(total, 0.5 * eq4.mean() + recon)
    paper = CapsNet(**SMALL_MODEL, margin_reduction="sum")
    torch.testing.assert_close(paper.margin_loss(out.lengths, y), eq4.sum(1).mean())


def test_official_init_draws_truncated_normals_and_constant_biases():
    torch.manual_seed(4)
    model = CapsNet(init="official", capsule_bias=True)
    weights = {"conv1": (model.conv1.weight, 0.05), "primary": (model.primary.conv.weight, 0.1),
               "W_ij": (model.class_caps.weight, 0.1), "decoder": (model.decoder.net[4].weight, 0.1)}  # fmt: skip
    for name, (w, std) in weights.items():
        assert w.abs().max() <= 2 * std, name  # tf.truncated_normal_initializer: redrawn beyond 2 std
        # the std of a normal truncated at ±2σ is 0.880 σ
        assert w.std().item() == pytest.approx(0.880 * std, rel=0.05), name
    for m in (model.conv1, model.primary.conv, *[m for m in model.decoder.net if hasattr(m, "bias")]):
        assert m.bias.eq(0.1).all()
    assert model.class_caps.bias.eq(0.1).all()
    own = CapsNet(init="official", router_init_std=0.02)  # an explicit std still wins
    assert own.class_caps.weight.std().item() == pytest.approx(0.880 * 0.02, rel=0.05)
    default = CapsNet()
    assert default.class_caps.weight.std().item() == pytest.approx(1 / math.sqrt(1152), rel=0.05)


def test_capsnet_config_json_without_the_new_keys_loads_as_it_was_trained(tmp_path):
    """A folder written before init, primary_routing, margin_reduction, primary_grouping, coupling (and
    capsule_bias) existed: `saved_defaults` rebuilds the model it holds, whatever today's defaults are."""
    assert CapsNet.saved_defaults == {
        "capsule_bias": False,
        "init": "pytorch",
        "primary_routing": False,
        "margin_reduction": "sum",
        "primary_grouping": "types",
        "coupling": "outputs",
        "digits": True,  # (every model's: RecordedData's, from before `digits` was recorded)
    }
    torch.manual_seed(5)
    model = CapsNet(**SMALL_MODEL).eval()
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    for key in CapsNet.saved_defaults:
        del meta["config"][key]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    loaded = load_pretrained(tmp_path)
    for key, value in CapsNet.saved_defaults.items():
        assert getattr(loaded.config, key) == value
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(loaded(x).lengths, model(x).lengths)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"coupling": "inputs", "routing": "self-routing"}, "options of dynamic routing"),
        ({"coupling": "inputs", "leaky_routing": True}, "needs coupling='outputs'"),
    ],
)
def test_capsnet_config_rejects_option_clashes(options, message):
    with pytest.raises(ConfigError, match=message):
        CapsNetConfig(**options)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--margin-reduction", "mean"], "invalid choice"),
        (["--init", "xavier"], "invalid choice"),
        (["--coupling", "inputs", "--routing", "inverted-attention"], "options of dynamic routing"),
        (["--model", "inverted-attention-capsnet", "--input-mean", "0.5", "--input-std", "0.2"], "one value per"),
        (["--model", "inverted-attention-capsnet", "--conv-windows", "mixed"], "invalid choice"),
    ],
)
def test_cli_bad_fidelity_options_give_one_line_and_exit_2(tmp_path, capsys, argv, message):
    try:
        code = main(["train", "--out", str(tmp_path / "run"), "--epochs", "1", "--train-subset", "8", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_the_official_codes_baseline_is_a_configuration_of_baselinecnn():
    """research/capsules models/conv_model.py: two 5×5 VALID convolutions of 512 and 256 channels, each followed by
    a 2×2 max-pool, one hidden layer of 1024 and the class layer, no dropout: 28 → 24 → 12 → 8 → 4."""
    code = BaselineCNN(channels=(512, 256), padding="valid", pool=True, hidden=(1024,), dropout=0.0)
    convs = (5 * 5 * 1 * 512 + 512) + (5 * 5 * 512 * 256 + 256)
    assert count_parameters(code) == convs + (256 * 4 * 4 * 1024 + 1024) + (1024 * 10 + 10) == 7_495_946
    assert count_parameters(BaselineCNN()) == 35_445_522  # the paper's, the default


def test_smallnorb_default_recipe_is_the_official_codes():
    """norb_input_record.py: random_brightness(max_delta=63) and random_contrast(0.2, 1.8) on the 0–255 image,
    random 32×32 crop, per_image_standardization; the centre crop (standardised) at test."""
    official = AugmentSpec(crop=(32, 32), brightness=63 / 255, contrast=(0.2, 1.8), standardize=True)
    assert DEFAULTS["smallnorb"] == official
    assert DEFAULTS["cifar10"] == AugmentSpec(crop=(24, 24), flip=True, brightness=63 / 255, contrast=(0.2, 1.8),
                                              standardize=True)  # fmt: skip


# ------------------------------------------------------------------ inverted attention: the authors' code
def test_inverted_attention_agreement_scale_defaults_to_the_authors_one_over_sqrt_d():
    assert InvertedAttentionCapsNetConfig().scale == 0.25
    assert InvertedAttentionCapsNetConfig(pose_dim=9).scale == pytest.approx(1 / 3)
    model = InvertedAttentionCapsNet(**SMALL_IA)
    assert [layer.scale for layer in model.capsules] == [0.25] * 3
    paper = InvertedAttentionCapsNet(**SMALL_IA, agreement_scale=1.0)  # Eq. 2 as printed: the named option
    assert [layer.scale for layer in paper.capsules] == [1.0] * 3


def test_inverted_attention_config_json_without_agreement_scale_keeps_the_papers(tmp_path):
    torch.manual_seed(6)
    model = InvertedAttentionCapsNet(**SMALL_IA, agreement_scale=1.0).eval()
    model.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    del meta["config"]["agreement_scale"]  # written before the key existed
    (tmp_path / "config.json").write_text(json.dumps(meta))
    loaded = load_pretrained(tmp_path)
    assert loaded.config.scale == 1.0
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(loaded(x).lengths, model(x).lengths)


def test_inverted_attention_input_normalisation_is_per_channel():
    torch.manual_seed(7)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
    normed = InvertedAttentionCapsNet(input_mean=mean, input_std=std).eval()
    plain = InvertedAttentionCapsNet().eval()
    plain.load_state_dict(normed.state_dict())  # the statistics are config, not weights
    x = torch.rand(2, 3, 32, 32)
    shifted = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(normed(x).lengths, plain(shifted).lengths)
    with pytest.raises(ConfigError, match="input_std must be > 0"):
        InvertedAttentionCapsNetConfig(input_mean=(0, 0, 0), input_std=(1, 0, 1))


def test_inverted_attention_resnet_backbone_has_the_authors_layers():
    """apple/ml-capsules-inverted-attention-routing src/layers.py resnet_backbone: 3×3 conv 3 → 64 without bias +
    BN, 3 basic blocks of 64, 4 of 128 (the first with stride 2 and a 1×1 conv + BN shortcut)."""
    model = InvertedAttentionCapsNet(backbone="resnet")
    bn = lambda c: 2 * c  # noqa: E731 (γ, β)
    block = lambda a, b: 9 * a * b + 9 * b * b + 2 * bn(b)  # noqa: E731
    expected = 3 * 9 * 64 + bn(64) + 3 * block(64, 64) + block(64, 128) + 64 * 128 + bn(128) + 3 * block(128, 128)
    assert count_parameters(model.backbone) == expected == 1_340_224
    assert model(torch.rand(2, 3, 32, 32)).lengths.shape == (2, 10)
