"""VB routing against the authors' released code (fabio-deep/Variational-Capsule-Routing, Apache-2.0), run here on the
same inputs with the same parameters copied in: outputs and gradients in float64 to 1e-6.

Their code is not part of capsnet. The tests find it through CAPSNET_VB_ROUTING_CODE (a checkout of the repository,
or its git directory) or CAPSNET_MIRRORS (a folder of fetched repositories, `fabio-deep+Variational-Capsule-Routing/
repo`), and skip without it. Their layers call `.cuda()` inside forward; here that is the identity (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from capsnet.models.vb_capsnet import VBCapsNet
from capsnet.routing.vb_conv import VBClassCaps, VBConvCaps
from capsnet.routing.vb_fc import VBRoutingFC

REPO = "fabio-deep+Variational-Capsule-Routing"


def _source(name: str) -> str | None:
    """src/NAME.py of their repository (a checkout or a git directory), or None."""
    roots = [os.environ.get("CAPSNET_VB_ROUTING_CODE", "")]
    if os.environ.get("CAPSNET_MIRRORS"):
        roots.append(str(Path(os.environ["CAPSNET_MIRRORS"]) / REPO / "repo"))
    for root in filter(None, roots):
        path = Path(root) / "src" / f"{name}.py"
        if path.is_file():
            return path.read_text(encoding="utf-8")
        if (Path(root) / "HEAD").is_file():
            done = subprocess.run(["git", "--git-dir", root, "show", f"HEAD:src/{name}.py"], capture_output=True,
                                  text=True, check=False)  # fmt: skip
            if done.returncode == 0:
                return done.stdout
    return None


@pytest.fixture(scope="module")
def theirs():
    """Their modules vb_routing, layers and capsnet, executed from their source."""
    sources = {name: _source(name) for name in ("vb_routing", "layers", "capsnet")}
    if any(s is None for s in sources.values()):
        pytest.skip("the authors' VB routing code is absent (set CAPSNET_VB_ROUTING_CODE or CAPSNET_MIRRORS)")
    modules = {}
    saved = {name: sys.modules.get(name) for name in sources}
    try:
        for name, text in sources.items():  # capsnet.py does `from layers import *` and `from vb_routing import *`
            module = types.ModuleType(name)
            exec(compile(text, f"their {name}.py", "exec"), module.__dict__)
            sys.modules[name] = modules[name] = module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return SimpleNamespace(**modules)


@pytest.fixture
def cpu_float64(monkeypatch):
    """Their `.cuda()` calls as the identity, and float64 by default (their constants are made with torch.tensor)."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(torch, "cholesky", lambda a, upper=False: torch.linalg.cholesky(a))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _their_routing(theirs, b, c, k, s, iterations, class_caps=False):
    return theirs.vb_routing.VariationalBayesRouting2d(
        in_caps=b, out_caps=c, pose_dim=4, kernel_size=k, stride=s, alpha0=1.0, m0=torch.zeros(16), kappa0=1.0,
        Psi0=torch.eye(16), nu0=17, cov="diag", iter=iterations, class_caps=class_caps,
    ).double()  # fmt: skip


def _random_betas(*modules, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in modules:
            for name in ("beta_u", "beta_a"):
                getattr(m, name).copy_(torch.randn(getattr(m, name).shape, generator=g, dtype=torch.float64))


def _their_inputs(batch, types_in, side, seed=1):
    """a [B, T, H, W] in (0, 1), poses [B, T, 4, 4, H, W] (their layout), as leaves."""
    g = torch.Generator().manual_seed(seed)
    a = (0.05 + 0.9 * torch.rand(batch, types_in, side, side, generator=g, dtype=torch.float64)).requires_grad_()
    poses = (0.5 * torch.randn(batch, types_in, 4, 4, side, side, generator=g, dtype=torch.float64)).requires_grad_()
    return a, poses


def _ours(a, poses):
    """Their layout -> capsnet's: poses [B, H, W, T, 16], activations [B, H, W, T]."""
    b, t, _, _, h, w = poses.shape
    return poses.permute(0, 4, 5, 1, 2, 3).reshape(b, h, w, t, 16), a.permute(0, 2, 3, 1)


def _check(got, want, inputs_got, inputs_want, layouts=(), seed=7):
    """Equal outputs, and equal gradients of one random linear function of them (`layouts`: functions from their
    layout of an input to ours, by position; the others only reshaped)."""
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-8)
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(y.shape, generator=g, dtype=torch.float64) for y in want]
    grads_got = torch.autograd.grad(sum((x * w).sum() for x, w in zip(got, weights)), inputs_got)
    grads_want = torch.autograd.grad(sum((y * w).sum() for y, w in zip(want, weights)), inputs_want)
    layouts = [*layouts, *[None] * (len(grads_got) - len(layouts))]
    for x, y, layout in zip(grads_got, grads_want, layouts, strict=True):
        torch.testing.assert_close(x, layout(y) if layout else y.reshape(x.shape), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("stride, iterations", [(2, 3), (1, 2), (1, 1)])
def test_conv_caps_equal_their_conv_capsules_and_vb_routing(theirs, cpu_float64, stride, iterations):
    t_in, t_out, k, side = 3, 4, 3, 7
    torch.manual_seed(0)
    caps = theirs.layers.ConvCapsules2d(in_caps=t_in, out_caps=t_out, pose_dim=4, kernel_size=k, stride=stride).double()
    routing = _their_routing(theirs, t_in, t_out, k, stride, iterations)
    ours = VBConvCaps(t_in, t_out, kernel_size=k, stride=stride, iterations=iterations).double()
    _random_betas(routing)

    def conv_w(w):  # their W [1, T_in, T_out, 1, 4, 4, 1, 1, K, K] -> ours [T_out, (ky, kx, t), 4, 4]
        return w[0, :, :, 0, :, :, 0, 0].permute(1, 4, 5, 0, 2, 3).reshape(t_out, -1, 4, 4)

    with torch.no_grad():
        ours.weight.copy_(conv_w(caps.W_ij))
        ours.beta_u.copy_(routing.beta_u.view(-1))
        ours.beta_a.copy_(routing.beta_a.view(-1))
    a, poses = _their_inputs(2, t_in, side)
    a_want, m_want = routing(*caps(a, poses))  # [B, C, F, F], [B, C, 4, 4, F, F]
    m_got, a_got = ours(*_ours(a, poses))  # [B, F, F, C, 16], [B, F, F, C]
    b, f = m_got.shape[0], m_got.shape[1]
    m_got = m_got.permute(0, 3, 4, 1, 2).reshape(b, t_out, 4, 4, f, f)
    params_got = [ours.weight, ours.beta_u, ours.beta_a]
    params_want = [caps.W_ij, routing.beta_u, routing.beta_a]
    _check([a_got.permute(0, 3, 1, 2), m_got], [a_want, m_want], [a, poses, *params_got], [a, poses, *params_want],
           layouts=[None, None, conv_w])  # fmt: skip


@pytest.mark.parametrize("side", [3, 4])
def test_class_caps_equal_their_class_capsules_with_their_coordinate_addition(theirs, cpu_float64, side):
    t_in, n = 3, 5
    torch.manual_seed(0)
    caps = theirs.layers.ConvCapsules2d(in_caps=t_in, out_caps=n, pose_dim=4, kernel_size=1, stride=1,
                                        share_W_ij=True, coor_add=True).double()  # fmt: skip
    routing = _their_routing(theirs, t_in, n, side, 1, 3, class_caps=True)
    # "authors" coordinate addition: 0.1 everywhere, a float32 0.1 as theirs (their coordinates are float32)
    ours = VBClassCaps(t_in, n, centres=torch.full((side * side, 2), 0.1, dtype=torch.float32)).double()
    _random_betas(routing)
    with torch.no_grad():
        ours.weight.copy_(caps.W_ij[0, :, :, 0, :, :, 0, 0, 0, 0].transpose(0, 1))
        ours.beta_u.copy_(routing.beta_u.view(-1))
        ours.beta_a.copy_(routing.beta_a.view(-1))
    a, poses = _their_inputs(3, t_in, side)
    a_want, m_want = routing(*caps(a, poses))  # [B, n], [B, n, 4, 4]
    m_got, a_got, _ = ours(*_ours(a, poses))
    params_got = [ours.weight, ours.beta_u, ours.beta_a]
    params_want = [caps.W_ij, routing.beta_u, routing.beta_a]
    _check([a_got, m_got.view(-1, n, 4, 4)], [a_want, m_want], [a, poses, *params_got], [a, poses, *params_want],
           layouts=[None, None, lambda w: w[0, :, :, 0, :, :, 0, 0, 0, 0].transpose(0, 1)])  # fmt: skip


def test_fully_connected_layer_is_their_routing_on_one_position(theirs, cpu_float64):
    """VBRoutingFC on vector votes = their class routing fed the same votes (a 1×1 output, children as a K×K grid),
    with their clamp of the normaliser."""
    b, side, t_in, n = 3, 2, 5, 4
    routing = _their_routing(theirs, t_in, n, side, 1, 3, class_caps=True)
    _random_betas(routing)
    ours = VBRoutingFC(t_in * side * side, n, 6, 16, min_normaliser=1e-11).double()
    with torch.no_grad():
        ours.beta_u.copy_(routing.beta_u.view(-1))
        ours.beta_a.copy_(routing.beta_a.view(-1))
    g = torch.Generator().manual_seed(4)
    u = (0.5 * torch.randn(b, t_in * side * side, 6, generator=g, dtype=torch.float64)).requires_grad_()
    act = (0.05 + 0.9 * torch.rand(b, t_in * side * side, generator=g, dtype=torch.float64)).requires_grad_()
    out = ours(u, act, return_weights=True)
    votes = torch.einsum("bin,ijnm->bijm", u, ours.weight)  # [B, I, J, 16], children ordered (type, y, x)
    v_theirs = votes.view(b, t_in, side, side, n, 16).permute(0, 1, 4, 5, 2, 3).reshape(b, t_in, n, 16, 1, 1, 1,
                                                                                         side, side)  # fmt: skip
    a_theirs = act.view(b, t_in, 1, 1, 1, 1, 1, side, side)
    a_want, m_want = routing(a_theirs, v_theirs)
    _check([out.activations, out.capsules], [a_want, m_want.reshape(b, n, 16)], [u, act, ours.beta_u],
           [u, act, routing.beta_u])  # fmt: skip


def test_their_network_has_our_parameter_count(theirs, cpu_float64):
    args = SimpleNamespace(pose_dim=4, arch=[64, 8, 16, 16, 5], n_channels=2, routing_iter=3)
    their_net = theirs.capsnet.CapsuleNet(args)
    assert sum(p.numel() for p in their_net.parameters()) == sum(p.numel() for p in VBCapsNet().parameters())
