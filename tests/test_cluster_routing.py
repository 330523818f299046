"""Cluster routing (Zhao & Cheng 2021): the layers against a literal loop transcription of the routing (value and
gradient, float64), its invariants, the fast paths against the computation as written, `--routing cluster` on the
paper's CapsNet, and the ClusterCapsNet model (parameter count, training from the command line, reload)."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import small_config

from capsnet import ConfigError
from capsnet.cli import main
from capsnet.configs.capsnet import CapsNetConfig
from capsnet.configs.cluster_capsnet import ClusterCapsNetConfig
from capsnet.models import CapsNet, load_pretrained
from capsnet.models.cluster_capsnet import ClusterCapsNet
from capsnet.routing.base import RoutingLayer, RoutingOutput
from capsnet.routing.cluster import ClusterRoutingFC, cluster_route, moments_pay
from capsnet.routing.cluster_conv import ClusterRoutingConv

QUICK = ["--train-subset", "32", "--test-subset", "32", "--epochs", "1", "--batch-size", "16", "--device", "cpu",
         "--no-progress", "--no-tensorboard"]  # fmt: skip


def loops(u, weight, bias, gamma, beta, eps=1e-5):
    """Literal transcription, one scalar at a time: V^k_ij = W^k_ij u_i + b^k_ij; μ_ij = mean_k V; σ_ij = the
    population std over k; c_ij = softmax_i(−log σ_ij) per dimension; v_j = LayerNorm(Σ_i c_ij μ_ij).
    u [B, I, N], weight [I, N, K, J, D], bias [I, K, J, D] -> v [B, J, D] (a differentiable tensor)."""
    n_b, n_in, n_d = u.shape
    _, _, k_votes, n_out, d_out = weight.shape
    out = []
    for b in range(n_b):
        parents = []
        for j in range(n_out):
            s = []
            for d in range(d_out):
                mus, logits = [], []
                for i in range(n_in):
                    votes = [sum(weight[i, n, k, j, d] * u[b, i, n] for n in range(n_d)) + bias[i, k, j, d]
                             for k in range(k_votes)]  # fmt: skip
                    mu = sum(votes) / k_votes
                    sigma = torch.sqrt(sum((v - mu) ** 2 for v in votes) / k_votes)
                    mus.append(mu)
                    logits.append(-torch.log(sigma))
                top = max(x.item() for x in logits)
                e = [torch.exp(x - top) for x in logits]
                s.append(sum(e[i] / sum(e) * mus[i] for i in range(n_in)))
            s = torch.stack(s)
            mean, var = s.mean(), ((s - s.mean()) ** 2).mean()
            parents.append((s - mean) / torch.sqrt(var + eps) * gamma + beta)
        out.append(torch.stack(parents))
    return torch.stack(out)


def _fc(n_in=3, n_out=2, d_in=2, d_out=3, votes=4, seed=0, **kw):
    torch.manual_seed(seed)
    layer = ClusterRoutingFC(n_in, n_out, d_in, d_out, votes=votes, **kw).double()
    with torch.no_grad():
        layer.norm.weight.normal_()
        layer.norm.bias.normal_()
    return layer


@pytest.mark.parametrize("fast", [True, False])
def test_fc_layer_is_the_loop_transcription_in_value_and_gradient(fast):
    layer = _fc(fast=fast)
    assert layer.fast == fast and moments_pay(12, layer.in_d, layer.votes)  # the moments path runs when fast
    u = torch.randn(12, 3, 2, dtype=torch.float64, requires_grad=True)
    params = [u, layer.weight, layer.bias, layer.norm.weight, layer.norm.bias]
    got, want = layer(u), loops(u, layer.weight, layer.bias, layer.norm.weight, layer.norm.bias)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_routing_step_gradcheck_and_the_written_backward():
    torch.manual_seed(1)
    votes = torch.randn(2, 3, 4, 2, 3, dtype=torch.float64, requires_grad=True)  # [B, I, K, J, D]
    assert torch.autograd.gradcheck(lambda v: cluster_route(v, child_dim=1, vote_dim=2), (votes,))
    layer = _fc(d_in=6, votes=3)  # in_d >= 2K − 2: the votes path even when fast
    u = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer(x), (u,))
    moments = _fc(votes=4)
    assert moments_pay(12, 2, 4) and not moments_pay(12, 6, 3)
    assert torch.autograd.gradcheck(lambda x: moments(x), (torch.randn(12, 3, 2, dtype=torch.float64,
                                                                         requires_grad=True),))  # fmt: skip


def test_weights_sum_to_one_and_the_tightest_cluster_leads():
    layer = _fc(n_in=4, n_out=3, votes=5)
    u = torch.randn(6, 4, 2, dtype=torch.float64)
    c = layer.coefficients(u)  # [B, I, J, D]
    torch.testing.assert_close(c.sum(dim=1), torch.ones(6, 3, 3, dtype=torch.float64))  # over the children
    out = layer(u, return_weights=True)
    assert isinstance(out, RoutingOutput) and out.activations is None
    torch.testing.assert_close(out.weights.sum(dim=2), torch.ones(6, 4, dtype=torch.float64))  # over the parents
    with torch.no_grad():  # child 0's votes agree (all K maps equal): σ = 0, floored, and it takes all the weight
        layer.weight[0] = layer.weight[0, :, :1].clone()
        layer.bias[0] = layer.bias[0, :1].clone()
    c = layer.coefficients(u)
    torch.testing.assert_close(c[:, 0], torch.ones_like(c[:, 0]))
    assert torch.isfinite(layer(u)).all()


def test_children_are_exchangeable_and_the_parents_layer_normed():
    layer = _fc(n_in=5, n_out=2, votes=3)
    with torch.no_grad():
        layer.norm.weight.fill_(1.0)
        layer.norm.bias.zero_()
    u = torch.randn(4, 5, 2, dtype=torch.float64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    permuted = _fc(n_in=5, n_out=2, votes=3)
    with torch.no_grad():
        permuted.load_state_dict(layer.state_dict())
        permuted.weight.copy_(layer.weight[perm])
        permuted.bias.copy_(layer.bias[perm])
    torch.testing.assert_close(layer(u), permuted(u[:, perm]))
    v = layer(u)
    torch.testing.assert_close(v.mean(dim=2), torch.zeros(4, 2, dtype=torch.float64))
    torch.testing.assert_close(
        v.var(dim=2, correction=0), torch.ones(4, 2, dtype=torch.float64), rtol=1e-2, atol=0
    )  # (ε = 1e-5)


def test_fast_paths_equal_the_computation_as_written_and_every_parameter_learns():
    torch.manual_seed(2)
    fast = ClusterRoutingFC(40, 10, 8, 16)
    slow = ClusterRoutingFC(40, 10, 8, 16, fast=False)
    slow.load_state_dict(fast.state_dict())
    u = torch.randn(48, 40, 8, requires_grad=True)
    assert moments_pay(48, 8, 8) and not moments_pay(47, 8, 8)  # (the batch pays for M from 48 images)
    torch.testing.assert_close(fast(u), slow(u), rtol=1e-4, atol=1e-4)
    fast(u).square().sum().backward()
    assert torch.isfinite(u.grad).all() and u.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in fast.parameters())  # fmt: skip
    assert isinstance(fast, RoutingLayer) and fast.iterations == 1
    no_bias = ClusterRoutingFC(40, 10, 8, 16, bias=False)
    assert no_bias.bias is None and torch.isfinite(no_bias(u)).all()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 2 votes"):
        ClusterRoutingFC(4, 2, 3, 3, votes=1)
    with pytest.raises(ValueError, match=r"\[B, 4, 3\]"):
        ClusterRoutingFC(4, 2, 3, 3)(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match=r"\[B, 2, 3, H, W\]"):
        ClusterRoutingConv(2, 2, 3, 4, (4, 4))(torch.randn(1, 3, 3, 4, 4))


# --------------------------------------------------------------------------------------------- the conv layer
def test_conv_layer_on_one_location_is_the_fc_layer():
    """A 1×1 kernel on a 1×1 grid: each input channel is one child capsule, and the layers agree."""
    torch.manual_seed(3)
    conv = ClusterRoutingConv(3, 2, 4, 5, (1, 1), votes=4, kernel_size=1, padding=0).double()
    fc = ClusterRoutingFC(3, 2, 4, 5, votes=4).double()
    with torch.no_grad():  # conv block i: [K·J·D, N] -> W_i [N, K, J, D]
        fc.weight.copy_(conv.conv.weight.view(3, 4, 2, 5, 4).permute(0, 4, 1, 2, 3))
        fc.bias.copy_(conv.conv.bias.view(3, 4, 2, 5))
        conv.norm.weight.normal_()
        fc.norm.weight.copy_(conv.norm.weight.view(5))
    u = torch.randn(6, 3, 4, dtype=torch.float64)
    v, c = conv(u[..., None, None], return_weights=True)
    torch.testing.assert_close(v[..., 0, 0], fc(u))
    torch.testing.assert_close(c[..., 0, 0], fc.coefficients(u))


@pytest.mark.parametrize("image_input", [False, True])
def test_conv_votes_are_one_convolution_per_input_channel(image_input):
    torch.manual_seed(4)
    layer = ClusterRoutingConv(3, 2, 4, 5, (3, 3), votes=2, stride=2, image_input=image_input).double()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64) if image_input else torch.randn(2, 3, 4, 6, 6).double()
    votes = layer.cluster_votes(x)  # [B, I, K, J, D, H', W']
    for i in range(3):
        block = slice(i * 20, (i + 1) * 20)
        want = F.conv2d(
            x if image_input else x[:, i], layer.conv.weight[block], layer.conv.bias[block], stride=2, padding=1
        )
        torch.testing.assert_close(votes[:, i], want.view(2, 2, 2, 5, 3, 3))
    out = layer(x)
    assert out.shape == (2, 2, 5, 3, 3)
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


# --------------------------------------------------------------------------------- --routing cluster in CapsNet
def test_capsnet_with_cluster_routing_has_its_parameters_and_a_classifier():
    model = CapsNet(routing="cluster")
    # dynamic's W (1152·10·8·16) becomes K = 8 vote maps and their biases, + LayerNorm 32 + classifier 17
    assert sum(p.numel() for p in model.parameters()) == 8_215_568 + 1152 * 10 * 16 * 8 * 8 + 32 + 17
    assert isinstance(model.class_caps, ClusterRoutingFC) and model.class_caps.votes == 8
    assert CapsNet(config=small_config(routing="cluster", cluster_votes=3)).class_caps.votes == 3


def test_cluster_votes_is_checked_and_only_cluster_routing_takes_it():
    with pytest.raises(ConfigError, match="cluster_votes must be >= 2"):
        CapsNetConfig(routing="cluster", cluster_votes=1)
    with pytest.raises(ConfigError, match=r"cluster_votes: options of cluster routing"):
        CapsNetConfig(routing="dynamic", cluster_votes=4)


def test_cli_trains_capsnet_with_cluster_routing_and_reloads_it(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--conv-channels", "8", "--primary-types", "2", "--primary-dim", "4", "--class-dim", "6",
             "--decoder-hidden", "16", "16", "--cluster-votes", "3"]  # fmt: skip
    assert main(["train", "--routing", "cluster", "--out", str(out), *QUICK, *flags]) == 0
    model = load_pretrained(out / "best")
    assert model.config.routing == "cluster" and model.class_caps.votes == 3
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(model.eval()(x).lengths, load_pretrained(out / "last").eval()(x).lengths)


# ----------------------------------------------------------------------------------------------- the model
def test_cluster_capsnet_has_the_derived_parameter_count():
    model = ClusterCapsNet()
    layers = [86_016 + 49_152, 666_624 + 12_288, 666_624 + 12_288, 666_624 + 3_072, 1_666_560 + 3_072]
    assert [sum(p.numel() for p in m.parameters()) for m in model.capsules] == layers
    assert sum(p.numel() for p in model.parameters()) == sum(layers) + 24 * 8 * 8 + 1 == 3_833_857
    assert ClusterCapsNetConfig().grids == [32, 16, 16, 8, 8]


def test_cluster_capsnet_outputs_a_loss_and_every_parameter_learns():
    model = ClusterCapsNet(in_channels=1, image_size=28, capsule_channels=2, votes=3, capsule_dim=4).train()
    images, labels = torch.rand(3, 1, 28, 28), torch.tensor([1, 5, 9])
    out = model(images, labels, return_coupling=True)
    assert out.lengths.shape == (3, 10) and out.capsules.shape == (3, 10, 4 * 7 * 7)
    torch.testing.assert_close(out.lengths.sum(dim=1), torch.ones(3))
    assert out.coupling.shape == (3, 2 * 7 * 7, 10)
    torch.testing.assert_close(out.coupling.sum(dim=2), torch.ones(3, 98))
    total, parts = model.loss(out, images, labels)
    torch.testing.assert_close(total, F.nll_loss(out.lengths.log(), labels))
    total.backward()
    assert math.isfinite(total.item()) and "total" in parts
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    "options,message",
    [({"votes": 1}, "votes must be >= 2"), ({"strides": (1,)}, "one positive value per capsule layer"),
     ({"strides": (1, 0)}, "one positive value"), ({"capsule_dim": 0}, "capsule_dim must be >= 1")],
)  # fmt: skip
def test_cluster_capsnet_config_is_checked(options, message):
    with pytest.raises(ConfigError, match=message):
        ClusterCapsNetConfig(**options)


def test_cli_trains_cluster_capsnet_and_reloads_it(tmp_path, capsys):
    out = tmp_path / "run"
    small = ["--capsule-channels", "2", "--votes", "3", "--capsule-dim", "4", "--strides", "2", "2", "1"]
    assert main(["train", "--model", "cluster-capsnet", "--out", str(out), *QUICK, *small]) == 0
    model = load_pretrained(out / "best")
    assert type(model) is ClusterCapsNet and model.config.strides == (2, 2, 1)


def test_cluster_capsnet_names_the_authors_input_pipelines():
    from capsnet.data.imageaug import AugmentSpec
    from capsnet.data.sources import FORMATS

    recipes = ClusterCapsNet.data_recipes
    assert set(recipes) == {"cifar10", "svhn"} <= set(FORMATS)
    cifar, svhn = (AugmentSpec.parse(recipes[k]["augment"]) for k in ("cifar10", "svhn"))
    # RandomCrop(32, padding=4) = a shift of up to 4 px filled with zeros; Normalize per channel
    assert (cifar.shift, cifar.zero_fill, cifar.flip, cifar.contrast, cifar.channel_standardize) == (
        4, True, True, (0.8, 1.2), True)  # fmt: skip
    assert (svhn.shift, svhn.zero_fill, svhn.flip, svhn.channel_standardize) == (4, True, False, True)
    assert ClusterCapsNet.default_batch_size == 64
