"""hvc-capsnet (Byerly, Kalganova & Dear 2021): parameter counts, the element-wise capsules against a literal loop,
the branch merge, the loss, gradients, save/load, its recipe in `capsnet train`, and bad configurations."""

import json

import pytest
import torch
import torch.nn.functional as F

from capsnet import load_pretrained
from capsnet.cli import main
from capsnet.data.imageaug import resolve_augment
from capsnet.errors import ConfigError
from capsnet.models.hvc_capsnet import (
    BatchNormShift,
    HomogeneousVectorCapsules,
    HVCCapsNet,
    HVCCapsNetConfig,
)
from capsnet.training.config import TrainConfig

TINY = {"channels": (4, 4, 6, 6, 6, 8, 8, 8, 8)}  # every layer of the paper's network, milliseconds per step


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------ parameter counts
def test_paper_network_has_1513686_parameters():
    model = HVCCapsNet()
    # 3×3 convolutions without bias: 9 · (1·32 + 32·48 + 48·64 + 64·80 + 80·96 + 96·112 + 112·128 + 128·144
    # + 144·160) = 9 · 84,000, and one BatchNorm shift β per channel: 32 + 48 + ... + 160 = 864
    assert sum(n_params(c[0]) for c in model.convs) == 756_000
    assert sum(n_params(c[1]) for c in model.convs) == 864
    # W [10, N, D] per branch: position capsules after conv 3, 6, 9: (22·22, 64), (16·16, 112), (10·10, 160);
    # BN shift per capsule dimension D
    assert [tuple(h.weight.shape) for h in model.hvcs.values()] == [(10, 484, 64), (10, 256, 112), (10, 100, 160)]
    assert [n_params(h) for h in model.hvcs.values()] == [309_760 + 64, 286_720 + 112, 160_000 + 160]
    assert n_params(model.merge_norm) == 3 and model.branch_weights.requires_grad
    assert n_params(model) == 1_513_686


def test_filter_capsules_with_equal_branch_weights_have_the_papers_listed_1514187():
    """1,514,187 trainable parameters: the figure listed for the paper (Papers with Code, "No Routing Needed Between
    Capsules"), which the arXiv v1-v5 layout gives: each feature map one capsule, fixed equal branch weights."""
    model = HVCCapsNet(capsule_layout="filter", branch_merge="equal")
    assert [tuple(h.weight.shape) for h in model.hvcs.values()] == [(10, 64, 484), (10, 112, 256), (10, 160, 100)]
    # the same 756,480 weights; BN shifts per dimension 484 + 256 + 100; branch weights a buffer
    assert "branch_weights" not in dict(model.named_parameters()) and "branch_weights" in dict(model.named_buffers())
    assert n_params(model) == 756_000 + 864 + 756_480 + 840 + 3 == 1_514_187


def test_small_preset_halves_the_widths():
    model = HVCCapsNet.small()
    assert model.config.channels == (16, 24, 32, 40, 48, 56, 64, 72, 80)
    # 9 · (1·16 + 16·24 + ... + 72·80) = 9 · 21,008 convolutions + 432 BN; W 10 · (484·32 + 256·56 + 100·80)
    # = 378,240 + BN 168; merge 6
    assert n_params(model) == 189_072 + 432 + 378_240 + 168 + 6 == 567_918


# ------------------------------------------------------------------------------------------ the layers
def test_homogeneous_vector_capsules_match_the_literal_loop():
    """v_j = ReLU(BN(Σ_i u_i ⊙ W_ij)); in evaluation, BN with running statistics μ, σ²: (s − μ)/sqrt(σ² + ε) + β."""
    torch.manual_seed(0)
    layer = HomogeneousVectorCapsules(5, 3, 4, momentum=0.1).eval()
    with torch.no_grad():
        layer.norm.running_mean.normal_()
        layer.norm.running_var.uniform_(0.5, 2.0)
        layer.norm.beta.normal_()
    u = torch.randn(2, 5, 4)
    expected = torch.zeros(2, 3, 4)
    for b in range(2):
        for j in range(3):
            s = sum(u[b, i] * layer.weight[j, i] for i in range(5))  # element-wise, no matrix mixes dimensions
            norm = layer.norm
            expected[b, j] = torch.relu((s - norm.running_mean) / torch.sqrt(norm.running_var + 1e-3) + norm.beta)
    torch.testing.assert_close(layer(u), expected)


def test_batchnorm_shift_normalises_per_channel_and_has_no_scale():
    bn = BatchNormShift(3, momentum=0.5).train()
    assert [name for name, _ in bn.named_parameters()] == ["beta"]
    with torch.no_grad():
        bn.beta.copy_(torch.tensor([0.0, 1.0, -2.0]))
    x = torch.randn(8, 3, 5) * 4 + 7
    y = bn(x)
    mean, var = x.mean(dim=(0, 2)), x.var(dim=(0, 2), unbiased=False)
    torch.testing.assert_close(y, (x - mean[:, None]) / torch.sqrt(var[:, None] + 1e-3) + bn.beta[:, None])
    torch.testing.assert_close(bn.running_mean, 0.5 * mean)  # momentum 0.5 from 0


def test_position_and_filter_capsules_read_the_feature_map_as_the_paper_says():
    """Position capsule i is the channel vector at position i; filter capsule c is feature map c, flattened."""
    seen: dict[str, torch.Tensor] = {}
    for layout in ("position", "filter"):
        torch.manual_seed(0)
        model = HVCCapsNet(**TINY, capsule_layout=layout, branches_after=(9,)).eval()
        model.convs[8].register_forward_hook(lambda m, args, out: seen.__setitem__("map", out))
        model.hvcs["9"].register_forward_pre_hook(lambda m, args: seen.__setitem__("u", args[0]))
        model(torch.rand(2, 1, 28, 28))
        x = seen["map"]  # the last feature map  [2, 8, 10, 10]
        if layout == "position":
            expected = torch.stack([x[:, :, r, c] for r in range(10) for c in range(10)], dim=1)  # [2, 100, 8]
        else:
            expected = torch.stack([x[:, k].reshape(2, 100) for k in range(8)], dim=1)  # [2, 8, 100]
        assert torch.equal(seen["u"], expected)
        assert model.config.branch_capsules(9) == tuple(expected.shape[1:])


def test_forward_merges_the_branches_and_the_loss_is_cross_entropy():
    torch.manual_seed(0)
    model = HVCCapsNet(**TINY).train()
    x, y = torch.rand(6, 1, 28, 28), torch.tensor([0, 1, 2, 3, 4, 5])
    out = model(x, y)
    assert out.capsules.shape == (6, 10, 8) and out.branch_lengths.shape == (6, 10, 3)
    assert (out.capsules >= 0).all()  # ReLU capsules
    torch.testing.assert_close(out.branch_lengths[..., 2], out.capsules.norm(dim=-1))  # the deepest branch
    # logits_j = Σ_b BN(w_b |v_j^(b)|): in training, batch statistics over the batch and the classes per branch
    z = out.branch_lengths * model.branch_weights
    mean, var = z.mean(dim=(0, 1)), z.var(dim=(0, 1), unbiased=False)
    torch.testing.assert_close(out.logits, ((z - mean) / torch.sqrt(var + 1e-3) + model.merge_norm.beta).sum(-1))
    torch.testing.assert_close(out.lengths.sum(dim=1), torch.ones(6))
    assert torch.equal(out.predictions, out.logits.argmax(dim=1))
    total, parts = model.loss(out, x, y)
    torch.testing.assert_close(total, F.cross_entropy(out.logits, y))
    assert set(parts) == {"cross_entropy", "total"}
    multi = torch.zeros(6, 10)
    multi[:, 0] = multi[:, 1] = 1
    torch.testing.assert_close(model.loss(out, x, multi)[0], F.cross_entropy(out.logits, multi / 2))
    with pytest.raises(ValueError, match="labels must be"):
        model.loss(out, x, torch.zeros(6, 3))


@pytest.mark.parametrize("options", [{}, {"capsule_layout": "filter", "branch_merge": "equal"}])
def test_every_parameter_gets_a_finite_gradient(options):
    torch.manual_seed(0)
    model = HVCCapsNet(**TINY, **options).train()
    x, y = torch.rand(4, 1, 28, 28), torch.tensor([1, 5, 9, 0])
    loss, _ = model.loss(model(x, y), x, y)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        if name == "merge_norm.beta":  # one shift shared by every class: the softmax is invariant to it
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.any(), name


def test_save_load_round_trip_and_inputs(tmp_path):
    torch.manual_seed(0)
    model = HVCCapsNet(**TINY, image_size=(30, 26), n_classes=4)
    model.train()(torch.rand(8, 1, 30, 26))  # move the running statistics off their start
    model.eval().save_pretrained(tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    assert isinstance(loaded, HVCCapsNet) and loaded.config == model.config and not loaded.training
    x = torch.rand(3, 1, 30, 26)
    assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(ValueError, match=r"\[B, 1, 30, 26\]"):
        model(torch.rand(3, 1, 28, 28))


@pytest.mark.parametrize("options,message", [
    ({"branches_after": (3, 12)}, "branches_after"),
    ({"branches_after": (6, 3)}, "branches_after"),
    ({"branches_after": ()}, "branches_after"),
    ({"image_size": 18}, "too small"),
    ({"channels": ()}, "channels"),
    ({"bn_momentum": 0.0}, "bn_momentum"),
    ({"n_classes": 1}, "n_classes"),
])  # fmt: skip
def test_bad_configurations_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        HVCCapsNetConfig(**options)


# ------------------------------------------------------------------------------------------ the recipe
def test_recipe_defaults():
    assert TrainConfig(model="hvc-capsnet").learning_rate == 1e-3
    assert TrainConfig(model="hvc-capsnet").decay_per_epoch == 0.98
    assert TrainConfig(model="hvc-capsnet", lr_decay=0.9).decay_per_epoch == 0.9
    assert HVCCapsNet.default_batch_size == 120 and HVCCapsNetConfig().bn_momentum == 0.1
    recipes = HVCCapsNet.data_recipes
    assert str(resolve_augment("auto", "idx", recipes=recipes)) == "hvc"
    assert str(resolve_augment("shift=2", "idx", recipes=recipes)) == "shift=2"  # --augment wins
    assert str(resolve_augment("auto", "idx")) == "shift=2"  # other models: the data set's default


def test_train_cli_uses_the_recipe(tmp_path, capsys):
    flags = ["--channels", *map(str, TINY["channels"]), "--train-subset", "24", "--test-subset", "16", "--epochs",
             "1", "--device", "cpu", "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(["train", "--model", "hvc-capsnet", *flags]) == 0
    out = capsys.readouterr().out
    assert "batch size 120 per process (hvc-capsnet's recipe" in out and "lr 0.001 (hvc-capsnet's default" in out
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["augment"] == "hvc" and meta["model"]["channels"] == list(TINY["channels"])
    assert main(["train", "--model", "hvc-capsnet", "--routing", "dynamic", *flags[:-1], str(tmp_path / "r2")]) == 2
    assert "--routing is not an option of --model hvc-capsnet" in capsys.readouterr().err
