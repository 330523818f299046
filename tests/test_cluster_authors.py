"""Cluster routing against its authors' released code (github.com/ZHAOZHIHAO/ClusterRouting, MIT,
src/capsule_network.py), run here on the same inputs with the same parameters copied in: outputs and gradients in
float64, to 1e-6.

Their code is not part of capsnet. The test looks for it in $CAPSNET_AUTHORS_CODE (default: a `.mirror` folder
beside the repository), in a folder `ZHAOZHIHAO+ClusterRouting` holding either a checkout or a bare git repository
`repo` (read with `git archive`), and skips, saying so, where it is absent.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import tarfile
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from capsnet.models.cluster_capsnet import ClusterCapsNet
from capsnet.routing.cluster import ClusterRoutingFC, moments_pay
from capsnet.routing.cluster_conv import ClusterRoutingConv

REPO = "ZHAOZHIHAO+ClusterRouting"
FILE = "src/capsule_network.py"
TOL = {"rtol": 1e-6, "atol": 1e-9}


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    """Their module capsule_network, imported from its file."""
    root = Path(os.environ.get("CAPSNET_AUTHORS_CODE", Path(__file__).resolve().parents[2] / ".mirror")) / REPO
    path = root / FILE
    if not path.is_file() and (root / "repo").is_dir():
        try:
            tar = subprocess.run(["git", "--git-dir", str(root / "repo"), "archive", "HEAD", FILE],
                                 capture_output=True, check=True, timeout=60).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            tar = b""
        if tar:
            folder = tmp_path_factory.mktemp("cluster_authors")
            with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
                archive.extractall(folder, filter="data")
            path = folder / FILE
    if not path.is_file():
        pytest.skip(f"the authors' code is absent: set CAPSNET_AUTHORS_CODE to a folder holding {REPO} (a checkout "
                    f"of github.com/ZHAOZHIHAO/ClusterRouting, or its bare git repository in {REPO}/repo)")  # fmt: skip
    spec = importlib.util.spec_from_file_location("cluster_routing_authors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_layer(ours: ClusterRoutingConv, layer, n_in: int) -> None:
    """Their conv_trans[i] (the first n_in: the ones their forward uses) -> our grouped convolution's block i."""
    with torch.no_grad():
        ours.conv.weight.copy_(torch.cat([layer.conv_trans[i].weight for i in range(n_in)]))
        ours.conv.bias.copy_(torch.cat([layer.conv_trans[i].bias for i in range(n_in)]))
        layer.acti.weight.normal_()  # (γ, β away from 1 and 0, so that their copies are checked too)
        layer.acti.bias.normal_()
        ours.norm.weight.copy_(layer.acti.weight)
        ours.norm.bias.copy_(layer.acti.bias)


def _grads(out: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    return torch.autograd.grad(
        (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum(), params, allow_unused=True
    )  # (their unused convolutions have none)


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_layer_is_their_caps_layer(theirs, first, stride):
    torch.manual_seed(0)
    c_in, c_out, votes, d_in, d_out, side = 3, 4, 5, 2, 3, 6
    out_side = side // stride
    layer = theirs.CapsLayerWithClusterRouting(c_in, c_out, votes, d_in, d_out, True, out_side, stride).double()
    ours = ClusterRoutingConv(c_in, c_out, d_in, d_out, (out_side, out_side), votes=votes, stride=stride,
                              image_input=first).double()  # fmt: skip
    _copy_layer(ours, layer, c_in)
    shape = (2, d_in, side, side) if first else (2, c_in, d_in, side, side)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    want = torch.stack(layer(x if first else list(x.unbind(1))), dim=1)  # their list of channels  [B, C_out, ...]
    got = ours(x)
    torch.testing.assert_close(got, want, **TOL)
    mine = [x, ours.conv.weight, ours.conv.bias, ours.norm.weight, ours.norm.bias]
    g_ours, g_theirs = _grads(got, mine), _grads(want, [x, *layer.parameters()])
    torch.testing.assert_close(g_ours[0], g_theirs[0], **TOL)  # the input's
    named = dict(zip([n for n, _ in layer.named_parameters()], g_theirs[1:], strict=True))
    w = torch.cat([named[f"conv_trans.{i}.weight"] for i in range(c_in)])
    b = torch.cat([named[f"conv_trans.{i}.bias"] for i in range(c_in)])
    for got_g, want_g in zip(g_ours[1:], [w, b, named["acti.weight"], named["acti.bias"]], strict=True):
        torch.testing.assert_close(got_g, want_g, **TOL)
    assert want.std() > 0.1  # (a comparison of values that differ)


def test_fc_layer_is_their_layer_on_a_one_by_one_grid(theirs):
    """On a 1×1 grid their 3×3 convolution (padding 1) reads only its centre tap: a linear map per input channel,
    the fully connected layer with W_i = the centre taps of conv_trans[i]."""
    torch.manual_seed(1)
    n_in, n_out, votes, d_in, d_out = 3, 4, 6, 5, 7  # (their layer needs C_out >= C_in: conv_trans has C_out)
    layer = theirs.CapsLayerWithClusterRouting(n_in, n_out, votes, d_in, d_out, True, 1, 1).double()
    for fast in (True, False):
        fc = ClusterRoutingFC(n_in, n_out, d_in, d_out, votes=votes, fast=fast).double()
        with torch.no_grad():
            for i in range(n_in):  # [K·J·D, N] -> [N, K, J, D]
                fc.weight[i] = (
                    layer.conv_trans[i].weight[:, :, 1, 1].view(votes, n_out, d_out, d_in).permute(3, 0, 1, 2)
                )
                fc.bias[i] = layer.conv_trans[i].bias.view(votes, n_out, d_out)
            fc.norm.weight.copy_(layer.acti.weight.view(-1))
            fc.norm.bias.copy_(layer.acti.bias.view(-1))
        u = torch.randn(32, n_in, d_in, dtype=torch.float64, requires_grad=True)
        assert moments_pay(32, d_in, votes)  # (fast: the moments path)
        want = torch.stack(layer([c[..., None, None] for c in u.unbind(1)]), dim=1)[..., 0, 0]  # [B, J, D]
        got = fc(u)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(_grads(got, [u])[0], _grads(want, [u])[0], **TOL)


def _their_args(**kw) -> Namespace:
    args = dict(C=4, K=8, D=24, input_img_dim=3, input_img_size=32, if_bias=True, class_num=10)
    return Namespace(**{**args, **kw})


def test_model_is_their_capsule_network(theirs):
    torch.manual_seed(2)
    args = _their_args(C=2, K=3, D=4, input_img_dim=3, input_img_size=8)
    net = theirs.CapsuleNetwork(args).double()
    model = ClusterCapsNet(in_channels=3, image_size=8, capsule_channels=2, votes=3, capsule_dim=4).double()
    layers = [net.caps_layer1, net.caps_layer2, net.caps_layer3, net.caps_layer4, net.caps_layer5]
    for ours, layer in zip(model.capsules, layers, strict=True):
        _copy_layer(ours, layer, args.C)
    with torch.no_grad():
        model.classifier.weight.copy_(net.classifier.weight)
        model.classifier.bias.copy_(net.classifier.bias)
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    want = net(x)  # their class logits  [B, 10]
    out = model(x)
    got = model.classifier(out.capsules).squeeze(-1)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(out.lengths, torch.softmax(want, dim=1), **TOL)
    g_ours = dict(zip([n for n, _ in model.named_parameters()], _grads(got, list(model.parameters()))))
    g_theirs = dict(zip([n for n, _ in net.named_parameters()], _grads(want, list(net.parameters()))))
    for k, name in enumerate(["caps_layer1", "caps_layer2", "caps_layer3", "caps_layer4", "caps_layer5"]):
        w = torch.cat([g_theirs[f"{name}.conv_trans.{i}.weight"] for i in range(args.C)])
        torch.testing.assert_close(g_ours[f"capsules.{k}.conv.weight"], w, **TOL)
        torch.testing.assert_close(g_ours[f"capsules.{k}.norm.bias"], g_theirs[f"{name}.acti.bias"], **TOL)
    torch.testing.assert_close(g_ours["classifier.weight"], g_theirs["classifier.weight"], **TOL)


def test_parameter_count_is_theirs_less_their_unused_convolutions(theirs):
    """Their last layer builds one vote convolution per output channel (10) and uses one per input channel (4)."""
    net = theirs.CapsuleNetwork(_their_args())
    unused = sum(p.numel() for i in range(4, 10) for p in net.caps_layer5.conv_trans[i].parameters())
    assert unused == 6 * 416_640
    total = sum(p.numel() for p in net.parameters())
    assert total == 6_333_697 and sum(p.numel() for p in ClusterCapsNet().parameters()) == total - unused
