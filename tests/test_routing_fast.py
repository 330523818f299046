"""The fast routing path (capsnet.routing) against the plain autograd path and the literal Procedure 1."""

import pytest
import torch
from helpers import check_bf16_autocast_routes_in_fp32
from reference import procedure1

from capsnet import Router, squash
from capsnet.routing.dynamic import dynamic_routing, route_votes
from capsnet.routing.dynamic_fast import default_chunk, fast_dynamic_routing


@pytest.fixture(autouse=True)
def _pytorch_fast_path(monkeypatch):
    """On CPU, Router would dispatch to the fused C++ kernel (tested in test_routing_cpu.py); these tests are about
    the pure-PyTorch fast path, which CAPSNET_NO_EXT=1 selects."""
    monkeypatch.setenv("CAPSNET_NO_EXT", "1")


def _run(fn, u, w, grad_v, grad_c):
    """Outputs (v, c) and the gradients of u and W of L = Σ v·grad_v + Σ c·grad_c."""
    u = u.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    v, c = fn(u, w)
    loss = (v * grad_v).sum() + (c * grad_c).sum()
    gu, gw = torch.autograd.grad(loss, (u, w), allow_unused=True)
    return v.detach(), c.detach(), gu, gw


def _plain(iterations, detach_votes):
    return lambda u, w: dynamic_routing(route_votes(w, u), iterations, detach_votes=detach_votes)


def _fast(iterations, detach_votes, chunk=None):
    return lambda u, w: fast_dynamic_routing(u, w, iterations, detach_votes=detach_votes, chunk=chunk)


def _inputs(batch, n_in, n_out, d_in, d_out, dtype, std=0.5):
    u = squash(torch.randn(batch, n_in, d_in, dtype=dtype))
    w = torch.randn(n_in, n_out, d_in, d_out, dtype=dtype) * std
    return u, w, torch.randn(batch, n_out, d_out, dtype=dtype), torch.randn(batch, n_in, n_out, dtype=dtype)


def _assert_all_close(got, expected, atol):
    for name, a, b in zip(("v", "c", "grad_u", "grad_W"), got, expected):
        if b is None:  # no gradient in the plain path (e.g. only through detached votes)
            assert a is None or a.abs().max() == 0, name
            continue
        assert a is not None, name
        assert (a - b).abs().max().item() <= atol, f"{name}: {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
@pytest.mark.parametrize("detach_votes", [False, True])
@pytest.mark.parametrize(("batch", "chunk"), [(1, None), (5, 2)])
def test_fast_matches_plain_and_literal_float64(iterations, detach_votes, batch, chunk):
    u, w, gv, gc = _inputs(batch, 6, 3, 4, 5, torch.float64)
    fast = _run(_fast(iterations, detach_votes, chunk), u, w, gv, gc)
    plain = _run(_plain(iterations, detach_votes), u, w, gv, gc)
    _assert_all_close(fast, plain, atol=1e-10)
    v_ref, c_ref = procedure1(w, u, iterations)
    assert torch.allclose(fast[0], torch.tensor(v_ref, dtype=torch.float64), atol=1e-10, rtol=0)
    assert torch.allclose(fast[1], torch.tensor(c_ref, dtype=torch.float64), atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 1, 2, 4), (1, 4, 1, 3)])
def test_degenerate_shapes(shape):
    u, w, gv, gc = _inputs(3, *shape, torch.float64)
    _assert_all_close(_run(_fast(3, False, 2), u, w, gv, gc), _run(_plain(3, False), u, w, gv, gc), atol=1e-10)


def test_fast_matches_plain_float32_medium_shape():
    torch.manual_seed(3)
    u, w, gv, gc = _inputs(13, 288, 10, 8, 16, torch.float32, std=10 / (288 * 16) ** 0.5)
    plain = _run(_plain(3, False), u, w, gv, gc)
    for chunk in (4, 13, None):
        _assert_all_close(_run(_fast(3, False, chunk), u, w, gv, gc), plain, atol=1e-5)


def test_gradcheck_fast_path_including_coupling():
    # (With detach_votes the gradient is deliberately not the derivative; it is compared with the plain path above.)
    u, w, _, _ = _inputs(3, 5, 3, 4, 2, torch.float64)
    u.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(_fast(3, False, chunk=2), (u, w), fast_mode=True)


def test_router_fast_and_plain_agree_and_return_coupling():
    torch.manual_seed(1)
    router = Router(32, 10, 8, 16, iterations=3)
    u = squash(torch.randn(6, 32, 8))
    assert router.fast
    fast = router(u, return_coupling=True)
    router.fast = False
    plain = router(u, return_coupling=True)
    assert fast.capsules.shape == (6, 10, 16) and fast.coupling.shape == (6, 32, 10)
    assert torch.allclose(fast.capsules, plain.capsules, atol=1e-6)
    assert torch.allclose(fast.coupling, plain.coupling, atol=1e-6)
    assert torch.allclose(fast.coupling.sum(dim=2), torch.ones(6, 32), atol=1e-6)
    router.fast = True
    assert torch.equal(router(u), fast.capsules)  # return_coupling=False returns v only


def test_only_one_input_requires_grad():
    u, w, gv, _ = _inputs(4, 6, 3, 4, 5, torch.float64)
    w.requires_grad_()
    v = fast_dynamic_routing(u, w, 3, chunk=3)[0]
    (gw,) = torch.autograd.grad((v * gv).sum(), (w,))
    w2 = w.detach().clone().requires_grad_()
    (gw2,) = torch.autograd.grad((dynamic_routing(route_votes(w2, u), 3)[0] * gv).sum(), (w2,))
    assert torch.allclose(gw, gw2, atol=1e-10)
    u.requires_grad_()
    w.requires_grad_(False)
    v = fast_dynamic_routing(u, w, 3, chunk=3)[0]
    assert torch.autograd.grad(v.sum(), (u,))[0].shape == u.shape


def test_double_backward_needs_the_plain_path():
    router = Router(6, 3, 4, 5, weight_std=0.5).double()
    u = squash(torch.randn(2, 6, 4, dtype=torch.float64)).requires_grad_()
    (g,) = torch.autograd.grad(router(u).pow(2).sum(), u, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()
    router.fast = False
    (g,) = torch.autograd.grad(router(u).pow(2).sum(), u, create_graph=True)
    g.pow(2).sum().backward()
    assert router.weight.grad is not None


def test_bf16_autocast_routes_in_fp32():
    check_bf16_autocast_routes_in_fp32()


def test_default_chunk():
    assert default_chunk(64, 1152, 10, 8, torch.device("cpu")) == 32
    assert default_chunk(100, 1152, 10, 8, torch.device("cpu")) == 34
    assert default_chunk(3, 1152, 10, 8, torch.device("cpu")) == 3
    assert default_chunk(5, 10**7, 10, 8, torch.device("cpu")) == 1
    assert default_chunk(64, 1152, 10, 8, torch.device("meta")) == 64
