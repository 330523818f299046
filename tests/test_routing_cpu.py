"""The fused CPU kernel (capsnet.routing.dynamic_cpu) against the literal Procedure 1 and the plain autograd path.

The extension must build here (CI installs ninja and has a C++ compiler): a build failure fails these tests.
"""

import pytest
import torch
from helpers import check_bf16_autocast_routes_in_fp32, run_without_extensions
from reference import procedure1

from capsnet import Router, squash
from capsnet.routing import dynamic_cpu as routing_cpu
from capsnet.routing.dynamic import dynamic_routing, route_votes

pytestmark = pytest.mark.slow  # the C++ extension build tier (`make test`; `make check` leaves it out)


@pytest.fixture(scope="module", autouse=True)
def ext():
    """Builds (or loads the cached) extension once for this module, explicitly (tests/conftest.py sets
    CAPSNET_NO_EXT=1 for the rest of the suite; here it is unset); fails, not skips, if it can't."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CAPSNET_NO_EXT", raising=False)
        yield routing_cpu.build()


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


def _kernel(iterations, detach_votes):
    return lambda u, w: routing_cpu.cpu_dynamic_routing(u, w, iterations, detach_votes=detach_votes)


def _inputs(batch, n_in, n_out, d_in, d_out, dtype, std=0.5):
    u = squash(torch.randn(batch, n_in, d_in, dtype=dtype))
    w = torch.randn(n_in, n_out, d_in, d_out, dtype=dtype) * std
    return u, w, torch.randn(batch, n_out, d_out, dtype=dtype), torch.randn(batch, n_in, n_out, dtype=dtype)


def _max_diffs(got, expected):
    out = {}
    for name, a, b in zip(("v", "c", "grad_u", "grad_W"), got, expected):
        if b is None:  # no gradient in the plain path
            out[name] = 0.0 if a is None else a.abs().max().item()
        else:
            assert a is not None, name
            out[name] = (a - b).abs().max().item()
    return out


def _assert_close(got, expected, atol):
    diffs = _max_diffs(got, expected)
    assert all(d <= atol for d in diffs.values()), diffs


@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
@pytest.mark.parametrize("detach_votes", [False, True])
@pytest.mark.parametrize("batch", [1, 5])
def test_kernel_matches_literal_and_plain_float64(ext, iterations, detach_votes, batch):
    u, w, gv, gc = _inputs(batch, 6, 3, 4, 5, torch.float64)
    got = _run(_kernel(iterations, detach_votes), u, w, gv, gc)
    _assert_close(got, _run(_plain(iterations, detach_votes), u, w, gv, gc), atol=1e-10)
    v_ref, c_ref = procedure1(w, u, iterations)
    assert torch.allclose(got[0], torch.tensor(v_ref, dtype=torch.float64), atol=1e-10, rtol=0)
    assert torch.allclose(got[1], torch.tensor(c_ref, dtype=torch.float64), atol=1e-10, rtol=0)


@pytest.mark.parametrize("detach_votes", [False, True])
def test_kernel_specialized_shape_float64(ext, detach_votes):
    # in_d = 8, out_d = 16 run the compile-time-specialized code; odd batch, more capsules than one block (32)
    u, w, gv, gc = _inputs(7, 70, 4, 8, 16, torch.float64, std=0.3)
    got = _run(_kernel(3, detach_votes), u, w, gv, gc)
    _assert_close(got, _run(_plain(3, detach_votes), u, w, gv, gc), atol=1e-10)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 1, 2, 4), (1, 4, 1, 3), (40, 70, 3, 2)])
def test_degenerate_and_large_out_shapes(ext, shape):
    u, w, gv, gc = _inputs(3, *shape, torch.float64)
    _assert_close(_run(_kernel(3, False), u, w, gv, gc), _run(_plain(3, False), u, w, gv, gc), atol=1e-10)


def test_only_v_or_only_c_gets_a_gradient(ext):
    u, w, gv, gc = _inputs(3, 6, 3, 4, 5, torch.float64)
    zero_v, zero_c = torch.zeros_like(gv), torch.zeros_like(gc)
    for g_v, g_c in ((gv, zero_c), (zero_v, gc)):
        _assert_close(_run(_kernel(3, False), u, w, g_v, g_c), _run(_plain(3, False), u, w, g_v, g_c), 1e-10)
    # c alone (v unused): autograd hands the kernel grad_v = None
    uu = u.clone().requires_grad_()
    (gu,) = torch.autograd.grad((routing_cpu.cpu_dynamic_routing(uu, w, 3)[1] * gc).sum(), (uu,))
    uu2 = u.clone().requires_grad_()
    (gu2,) = torch.autograd.grad((_plain(3, False)(uu2, w)[1] * gc).sum(), (uu2,))
    assert (gu - gu2).abs().max() <= 1e-10


def test_only_one_input_requires_grad(ext):
    u, w, gv, _ = _inputs(4, 6, 3, 4, 5, torch.float64)
    w.requires_grad_()
    (gw,) = torch.autograd.grad((routing_cpu.cpu_dynamic_routing(u, w, 3)[0] * gv).sum(), (w,))
    w2 = w.detach().clone().requires_grad_()
    (gw2,) = torch.autograd.grad((_plain(3, False)(u, w2)[0] * gv).sum(), (w2,))
    assert (gw - gw2).abs().max() <= 1e-10
    u.requires_grad_()
    w.requires_grad_(False)
    v = routing_cpu.cpu_dynamic_routing(u, w, 3)[0]
    assert torch.autograd.grad(v.sum(), (u,))[0].shape == u.shape


def test_gradcheck(ext):
    u, w, _, _ = _inputs(3, 5, 3, 4, 2, torch.float64)
    u.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(_kernel(3, False), (u, w))


def test_float32_mnist_shape_matches_plain(ext):
    torch.manual_seed(3)
    u, w, gv, gc = _inputs(8, 1152, 10, 8, 16, torch.float32, std=10 / (1152 * 16) ** 0.5)
    got = _run(_kernel(3, False), u, w, gv, gc)
    _assert_close(got, _run(_plain(3, False), u, w, gv, gc), atol=1e-5)
    assert got[0].dtype == torch.float32


def test_grad_w_is_deterministic_across_thread_counts(ext):
    u, w, gv, gc = _inputs(9, 100, 10, 8, 16, torch.float32, std=0.1)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_run(_kernel(3, False), u, w, gv, gc))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_router_uses_the_kernel_on_cpu(ext, monkeypatch):
    torch.manual_seed(1)
    router = Router(32, 10, 8, 16, iterations=3)
    u = squash(torch.randn(6, 32, 8))
    calls = []
    original = routing_cpu.CpuRouting.apply
    monkeypatch.setattr(routing_cpu.CpuRouting, "apply", lambda *a: calls.append(1) or original(*a))
    fast = router(u, return_coupling=True)
    assert calls
    router.fast = False
    plain = router(u, return_coupling=True)
    assert len(calls) == 1  # fast=False: the plain autograd path
    assert torch.allclose(fast.capsules, plain.capsules, atol=1e-6)
    assert torch.allclose(fast.coupling, plain.coupling, atol=1e-6)


def test_bf16_autocast_routes_in_fp32(ext):
    check_bf16_autocast_routes_in_fp32()


def test_fallback_without_the_extension():
    code = (
        "import torch, warnings\n"
        "warnings.simplefilter('error')\n"
        "from capsnet import Router, squash\n"
        "from capsnet.routing import dynamic_cpu as routing_cpu\n"
        "from capsnet.routing.dynamic_fast import FastRouting\n"
        "assert not routing_cpu.available()\n"
        "calls = []\n"
        "orig = FastRouting.apply\n"
        "FastRouting.apply = lambda *a: calls.append(1) or orig(*a)\n"
        "r = Router(6, 3, 4, 5).double()\n"
        "u = squash(torch.randn(2, 6, 4, dtype=torch.float64)).requires_grad_()\n"
        "v = r(u)\n"
        "v.sum().backward()\n"
        "assert calls and u.grad is not None\n"
        "print('ok')\n"
    )
    assert run_without_extensions(code).strip().endswith("ok")
