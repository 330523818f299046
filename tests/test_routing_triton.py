"""The Triton kernels of dynamic routing (capsnet.routing.dynamic_triton): on the CPU under Triton's interpreter
against the autograd reference (float64, to rounding) and against the C++ kernel's outputs (the operator's shared
contract); their launch plan; and, on a GPU, the compiled kernels inside Router, the operator and torch.compile."""

import importlib.util

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet, Router, squash
from capsnet.errors import ConfigError
from capsnet.routing import dynamic_triton, use_backend
from capsnet.routing.dynamic import dynamic_routing, route_votes
from capsnet.routing.dynamic_triton import TILE, Launch

HAS_TRITON = importlib.util.find_spec("triton") is not None
SPLIT = Launch(bb=2, bi=4, n_split=2, slice_len=8, bi2=2, chunk=2)  # two slices of input capsules, batch chunks of 2


def interpreted(test):
    """Marks a test that runs the kernels under Triton's interpreter: `triton` and `slow` (make check skips it)."""
    needs = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (pip install 'capsnet[triton]')")
    return pytest.mark.triton(pytest.mark.slow(needs(pytest.mark.usefixtures("interpreter")(test))))


def on_gpu(test):
    needs = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and Triton")
    return pytest.mark.cuda(needs(test))


@pytest.fixture(scope="module")
def interpreter():
    """The kernels as Triton's interpreter runs them (NumPy, on CPU tensors): tests/conftest.py sets
    TRITON_INTERPRET=1 on machines without CUDA."""
    k = dynamic_triton.kernels()
    if k is None or type(k.forward_pass).__name__ != "InterpretedFunction":
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1 before Triton is imported; no CUDA GPU)")


def _inputs(batch=3, n_in=13, n_out=3, d_in=4, d_out=5, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    u = squash(torch.randn(batch, n_in, d_in, generator=g, dtype=dtype))
    w = torch.randn(n_in, n_out, d_in, d_out, generator=g, dtype=dtype) * 0.3
    gv = torch.randn(batch, n_out, d_out, generator=g, dtype=dtype)
    gc = torch.randn(batch, n_in, n_out, generator=g, dtype=dtype)
    return [t.to(device) for t in (u, w, gv, gc)]


def _reference(u, w, gv, gc, iterations, detach_votes=False):
    """v, c, dL/du, dL/dW of the plain autograd path in float64 on the CPU, L = Σ v·gv + Σ c·gc (gc may be None)."""
    u, w = (t.detach().cpu().double().requires_grad_() for t in (u, w))
    v, c = dynamic_routing(route_votes(w, u), iterations, detach_votes=detach_votes)
    loss = (v * gv.cpu().double()).sum() + ((c * gc.cpu().double()).sum() if gc is not None else 0)
    return v.detach(), c.detach(), *torch.autograd.grad(loss, (u, w))


@interpreted
@pytest.mark.parametrize("iterations, detach_votes, with_gc, launch", [
    (1, False, True, SPLIT), (2, False, True, SPLIT), (3, False, True, SPLIT), (3, False, False, SPLIT),
    (3, True, True, SPLIT), (3, False, True, None),
], ids=["r1", "r2", "r3", "r3-no-grad-c", "r3-detach", "r3-planned"])  # fmt: skip
def test_kernels_equal_the_reference_in_float64(iterations, detach_votes, with_gc, launch):
    u, w, gv, gc = _inputs()
    gc = gc if with_gc else None
    v_ref, c_ref, du_ref, dw_ref = _reference(u, w, gv, gc, iterations, detach_votes)
    v, c_all, s_all = dynamic_triton.forward(u, w, iterations, launch)
    assert c_all.shape == (iterations - 1, 3, 13, 3) and s_all.shape == (3, iterations, 3, 5)
    du, dw = dynamic_triton.backward(gv, gc, u, w, c_all, s_all, iterations, detach_votes, True, True, launch)
    got = {"v": v, "du": du, "dw": dw, **({"c": c_all[-1]} if iterations > 1 else {})}
    want = {"v": v_ref, "c": c_ref, "du": du_ref, "dw": dw_ref}
    for name, value in got.items():
        assert value.dtype == torch.float64 and (value - want[name]).abs().max().item() < 1e-12, name


@interpreted
def test_kernels_in_float32_and_gradients_only_where_needed():
    u, w, gv, gc = _inputs(batch=5, n_in=9, n_out=4, d_in=3, d_out=4, dtype=torch.float32, seed=1)
    v_ref, _, du_ref, dw_ref = _reference(u, w, gv, gc, 3)
    v, c_all, s_all = dynamic_triton.forward(u, w, 3, SPLIT)
    du, dw = dynamic_triton.backward(gv, gc, u, w, c_all, s_all, 3, False, True, False, SPLIT)
    assert dw is None and du.dtype == v.dtype == torch.float32
    du2, dw = dynamic_triton.backward(gv, gc, u, w, c_all, s_all, 3, False, False, True, SPLIT)
    assert du2 is None and dw.shape == w.shape
    for got, want in ((v, v_ref), (du, du_ref), (dw, dw_ref)):
        assert (got.double() - want).abs().max().item() < 2e-6 * max(1.0, want.abs().max().item())


@interpreted
@pytest.mark.parametrize("iterations, detach_votes", [(3, False), (3, True), (1, False)])
def test_the_cuda_kernel_of_the_operator_returns_what_the_cpu_kernel_does(iterations, detach_votes, routing_kernel):
    """The operator's CUDA implementation (here on CPU tensors, interpreted) against its C++ CPU kernel (built
    explicitly): the same outputs and saved tensors, the same gradients from them; so the autograd registration
    serves both."""
    u, w, gv, gc = _inputs()
    ours = dynamic_triton._cuda_routing(u, w, iterations, detach_votes)
    theirs = torch.ops.capsnet.routing_cpu(u, w, iterations, detach_votes)
    for name, a, b in zip(("v", "c", "c_all", "s_all", "u", "W"), ours, theirs, strict=True):
        assert a.shape == b.shape and a.is_contiguous(), name
        assert a.numel() == 0 or (a - b).abs().max().item() < 1e-12, name
    saved = theirs[4], theirs[5], theirs[2], theirs[3]
    back = dynamic_triton._cuda_routing_backward(gv, gc, *saved, iterations, detach_votes, True, True)
    expected = torch.ops.capsnet.routing_cpu_backward(gv, gc, *saved, iterations, detach_votes, True, True)
    for a, b in zip(back, expected, strict=True):
        assert (a - b).abs().max().item() < 1e-12


@pytest.mark.parametrize("shape, programs", [
    ((512, 1152, 10, 8, 16), 528), ((128, 1152, 10, 8, 16), 528), ((3, 13, 3, 4, 5), 4), ((1, 1, 2, 1, 1), 4),
    ((64, 2048, 100, 8, 32), 528), ((7, 5, 33, 16, 64), 528),
])  # fmt: skip
def test_the_launch_plan_covers_every_capsule_in_small_tiles(shape, programs):
    batch, n_in, n_out, d_in, d_out = shape
    plan = Launch.plan(batch, n_in, n_out, d_in, d_out, programs)
    pair = dynamic_triton._pow2(n_out) * dynamic_triton._pow2(d_out)
    for size in (plan.bb, plan.bi, plan.bi2):
        assert size >= 1 and size & (size - 1) == 0  # powers of two (Triton's block sizes)
    assert plan.bb * plan.bi * pair <= max(TILE, pair) and plan.bi2 * pair * dynamic_triton._pow2(d_in) <= max(
        TILE, pair * dynamic_triton._pow2(d_in))  # fmt: skip
    assert plan.slice_len % plan.bi == 0 and (plan.n_split - 1) * plan.slice_len < n_in <= plan.n_split * plan.slice_len
    assert 1 <= plan.chunk <= batch


def test_without_the_switch_router_keeps_its_paths(monkeypatch):
    monkeypatch.delenv("CAPSNET_TRITON", raising=False)
    assert not dynamic_triton.enabled()
    monkeypatch.setenv("CAPSNET_TRITON", "1")
    assert dynamic_triton.enabled()
    u, w, _, _ = _inputs(dtype=torch.float32)
    assert not dynamic_triton.applicable(u, w)  # CPU tensors: the C++ kernel's, never Triton's


def test_the_triton_backend_chooses_the_kernels_and_auto_only_with_the_switch(monkeypatch):
    monkeypatch.delenv("CAPSNET_TRITON", raising=False)
    assert not dynamic_triton.chosen() and not dynamic_triton.chosen("torch") and not dynamic_triton.chosen("cpp")
    with use_backend("triton"):
        assert dynamic_triton.chosen()
        u, w, _, _ = _inputs(dtype=torch.float32)
        assert not dynamic_triton.applicable(u, w)  # (CUDA tensors only)
    assert dynamic_triton.chosen("triton")  # a layer's own choice
    monkeypatch.setattr(dynamic_triton, "kernels", lambda: None)  # Triton missing: "triton" says so, "auto" falls back
    with pytest.raises(ConfigError, match="routing backend 'triton' needs Triton"):
        dynamic_triton.chosen("triton")


# ------------------------------------------------------------------------------------------------ on a GPU
@on_gpu
@pytest.mark.parametrize("detach_votes", [False, True])
@pytest.mark.parametrize("shape, tol", [((5, 24, 4, 4, 6), 2e-5), ((64, 1152, 10, 8, 16), 1e-4)],
                         ids=["small", "mnist"])  # (float32 sums over 1152 capsules)  # fmt: skip
def test_router_on_cuda_with_the_kernels_matches_float64(monkeypatch, shape, tol, detach_votes):
    calls = []
    monkeypatch.setattr(dynamic_triton, "forward", lambda *a, f=dynamic_triton.forward: calls.append(1) or f(*a))
    batch, n_in, n_out, d_in, d_out = shape
    u, w, gv, gc = _inputs(batch, n_in, n_out, d_in, d_out, dtype=torch.float32, device="cuda")
    router = Router(n_in, n_out, d_in, d_out, 3, detach_votes=detach_votes).cuda()
    router.backend = "triton"  # (the suite's CAPSNET_NO_EXT=1 makes "auto" the PyTorch path: tests/conftest.py)
    with torch.no_grad():
        router.weight.copy_(w)
    x = u.clone().requires_grad_()
    v, c = router(x, return_coupling=True)
    ((v * gv).sum() + (c * gc).sum()).backward()
    got = [v, c, x.grad, router.weight.grad]
    for name, a, b in zip(("v", "c", "du", "dw"), got, _reference(u, w, gv, gc, 3, detach_votes), strict=True):
        assert a.is_cuda and (a.double().cpu() - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), name
    assert router.weight.grad.stride() == router.weight.stride()
    assert calls  # the Triton kernels ran, not the PyTorch path (which matches float64 too)


@on_gpu
def test_the_operator_passes_opcheck_on_cuda():
    u, w, _, _ = _inputs(batch=3, n_in=6, n_out=3, d_in=4, d_out=5, dtype=torch.float32, device="cuda")
    torch.library.opcheck(torch.ops.capsnet.routing_cpu.default, (u.requires_grad_(), w.requires_grad_(), 3, False))


@on_gpu
def test_compiled_model_on_cuda_sees_routing_as_one_node_and_trains_as_eager(monkeypatch):
    monkeypatch.setenv("CAPSNET_TRITON", "1")
    monkeypatch.delenv("CAPSNET_NO_EXT", raising=False)  # the suite's setting makes "auto" the PyTorch path
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CapsNet(config=small_config()).cuda()
    x, y = torch.rand(8, 1, 28, 28, device="cuda"), torch.randint(0, 10, (8,), device="cuda")

    def step(x, y):
        return model.loss(model(x, y), x, y)[0]

    explained = torch._dynamo.explain(step)(x, y)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("capsnet.routing_cpu" in op for op in ops), ops
    eager = step(x, y)
    eager.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(step)(x, y)
    compiled.backward()
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6)
