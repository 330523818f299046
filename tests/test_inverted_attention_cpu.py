"""The fused CPU kernel of inverted dot-product attention routing (capsnet.routing.inverted_attention_cpu) against
the PyTorch reference the layers keep (`layer.fast = False`: votes, then inverted_attention_step per pass) and the
literal Procedure 1 of tests/reference_routing.py: values and gradients in float64 and float32, the operator's
opcheck, zero input, concurrent routing, and the fallback when the extension is disabled.

The extension must build here (a C++ compiler and ninja): a build failure fails these tests.
"""

import pytest
import reference_routing as ref
import torch
from helpers import run_without_extensions

from capsnet.routing import InvertedAttentionConv, InvertedAttentionFC, concurrent_routing
from capsnet.routing import inverted_attention_cpu as ia_cpu

pytestmark = pytest.mark.slow  # the C++ extension build tier, as tests/test_routing_cpu.py


@pytest.fixture(scope="module", autouse=True)
def ext():
    """Builds (or loads the cached) extension once for this module, explicitly (tests/conftest.py sets
    CAPSNET_NO_EXT=1 for the rest of the suite; here it is unset); fails, not skips, if it can't."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CAPSNET_NO_EXT", raising=False)
        yield ia_cpu.build()


def _randomize(layer, scale=0.5):
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return layer


def _run(layer, fast, u, parent, steps, grad_p, grad_r):
    """Poses, routing weights and the gradients (u, parameters, parent) of L = Σ p·grad_p + Σ r·grad_r."""
    layer.fast = fast
    u = u.detach().clone().requires_grad_()
    parent = None if parent is None else parent.detach().clone().requires_grad_()
    p, r = layer.passes(u, parent, steps)
    leaves = [u, *layer.parameters(), *([parent] if parent is not None else [])]
    grads = torch.autograd.grad((p * grad_p).sum() + (r * grad_r).sum(), leaves, allow_unused=True)
    return [p.detach(), r.detach(), *grads]


def _assert_close(got, want, tol):
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:  # no dependence in the reference (e.g. the uniform weights of a single pass from 0)
            assert a is None or a.abs().max().item() == 0, k
            continue
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), k


CASES = [  # (steps, with a given parent, matrix poses)
    (1, False, False), (2, False, False), (3, False, False), (1, True, False), (3, True, False),
    (1, False, True), (3, False, True), (2, True, True),
]  # fmt: skip


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("steps,with_parent,matrix_pose", CASES)
def test_kernel_equals_the_reference_in_value_and_gradient(ext, dtype, tol, steps, with_parent, matrix_pose):
    torch.manual_seed(steps + 10 * with_parent + 100 * matrix_pose)
    d_in, d_out = (4, 4) if matrix_pose else (3, 5)
    layer = InvertedAttentionFC(37, 4, d_in, d_out, matrix_pose=matrix_pose, agreement_scale=0.7)
    layer = _randomize(layer).to(dtype)
    u = torch.randn(5, 37, d_in, dtype=dtype)
    parent = torch.randn(5, 4, d_out, dtype=dtype) if with_parent else None
    gp, gr = torch.randn(5, 4, d_out, dtype=dtype), torch.randn(5, 37, 4, dtype=dtype)
    fast = _run(layer, True, u, parent, steps, gp, gr)
    _assert_close(fast, _run(layer, False, u, parent, steps, gp, gr), tol)
    if dtype == torch.float32:  # and against float64: the fp32 kernel within 1e-5 of the exact result
        parent64 = None if parent is None else parent.double()
        _assert_close(fast, _run(layer.double(), False, u.double(), parent64, steps, gp.double(), gr.double()), tol)


def test_capsnet_size_equals_the_reference_fp32(ext):
    """At CapsNet's class-capsule size (1152 × 8D → 10 × 16D, 3 iterations), batch 2, outputs and gradients."""
    torch.manual_seed(0)
    layer = InvertedAttentionFC(1152, 10, 8, 16, 3)
    u = torch.randn(2, 1152, 8) * 0.3
    gp, gr = torch.randn(2, 10, 16), torch.randn(2, 1152, 10)
    _assert_close(_run(layer, True, u, None, 3, gp, gr), _run(layer, False, u, None, 3, gp, gr), 1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_4x4_matrix_poses_equal_the_reference(ext, dtype, tol):
    """Tsai et al.'s 4×4 pose matrices (the kernel's compiled-in size), with a given parent and from p = 0."""
    torch.manual_seed(9)
    layer = _randomize(InvertedAttentionFC(50, 10, 16, 16, matrix_pose=True), 0.3).to(dtype)
    u, parent = torch.randn(3, 50, 16, dtype=dtype), torch.randn(3, 10, 16, dtype=dtype)
    gp, gr = torch.randn(3, 10, 16, dtype=dtype), torch.randn(3, 50, 10, dtype=dtype)
    for start, steps in ((None, 3), (parent, 2)):
        _assert_close(_run(layer, True, u, start, steps, gp, gr), _run(layer, False, u, start, steps, gp, gr), tol)


@pytest.mark.parametrize("matrix_pose", [False, True])
def test_layer_default_matches_the_literal_procedure(ext, matrix_pose):
    """The layer as constructed (fast) against the element-by-element transcription, with return_weights."""
    torch.manual_seed(3)
    d = 4
    layer = _randomize(InvertedAttentionFC(6, 3, d, d, 3, matrix_pose=matrix_pose)).double()
    assert layer.fast
    u = torch.randn(2, 6, d, dtype=torch.float64, requires_grad=True)
    out = layer(u, return_weights=True)
    p, r = ref.inverted_attention(layer.weight, layer.norm.weight, layer.norm.bias, u, 3, matrix_pose=matrix_pose)
    assert (out.capsules - p).abs().max().item() < 1e-12 and (out.weights - r).abs().max().item() < 1e-12
    probe = torch.randn_like(p)
    got = torch.autograd.grad((out.capsules * probe).sum(), (u, layer.weight))
    want = torch.autograd.grad((p * probe).sum(), (u, layer.weight))
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() < 1e-12


def test_finite_gradients_at_zero_input(ext):
    layer = _randomize(InvertedAttentionFC(9, 4, 3, 5, 3))
    u = torch.zeros(2, 9, 3, requires_grad=True)
    out = layer(u, return_weights=True)
    (out.capsules.sum() + out.weights.sum()).backward()
    grads = [u.grad, *(p.grad for p in layer.parameters())]
    assert torch.isfinite(out.capsules).all() and all(torch.isfinite(g).all() for g in grads)
    assert torch.allclose(out.weights, torch.full_like(out.weights, 1 / 4))  # zero votes: every agreement is 0


def test_concurrent_routing_and_conv_equal_the_reference(ext):
    """Tsai et al.'s stacked layers (§2.2) take the same path: conv + FC, concurrent, kernel vs reference."""
    torch.manual_seed(4)
    layers = [_randomize(InvertedAttentionConv(2, 3, 4, kernel_size=3, stride=2)).double(),
              _randomize(InvertedAttentionFC(3 * 2 * 2, 5, 4, 4, matrix_pose=True)).double()]  # fmt: skip
    u = torch.randn(3, 2, 5, 6, 4, dtype=torch.float64)
    results = []
    for fast in (True, False):
        for layer in layers:
            layer.fast = fast
        uu = u.clone().requires_grad_()
        poses, r = concurrent_routing(layers, uu, 3)
        probe = torch.ones_like(poses[-1]).cumsum(-1)
        params = [p for layer in layers for p in layer.parameters()]
        results.append([*poses, r, *torch.autograd.grad((poses[-1] * probe).sum(), [uu, *params])])
    _assert_close(results[0], results[1], 1e-12)


def test_custom_op_passes_opcheck(ext):
    """Schema, fake implementation, autograd registration and AOT dispatch of `capsnet::inverted_attention_cpu`."""
    torch.manual_seed(5)
    u = torch.randn(3, 6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, 3, 5, dtype=torch.float64, requires_grad=True)
    gamma = torch.randn(5, dtype=torch.float64, requires_grad=True)
    beta = torch.randn(5, dtype=torch.float64, requires_grad=True)
    parent = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    op = torch.ops.capsnet.inverted_attention_cpu.default
    torch.library.opcheck(op, (u, w, gamma, beta, None, 3, 1.0, 1e-5, False))
    torch.library.opcheck(op, (u, w, gamma, beta, parent, 2, 0.5, 1e-5, False))
    u4 = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)  # 2×2 matrix poses: weight rows [6, 4, 2, 4]
    w4 = torch.randn(6, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    g4, b4, p4 = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((4,), (4,), (3, 4, 4)))
    torch.library.opcheck(op, (u4, w4, g4, b4, p4, 2, 1.0, 1e-5, True))


def test_results_do_not_depend_on_the_number_of_threads(ext):
    """The batch sums of dL/dW, dγ, dβ run in a fixed order: bitwise equal with 1 and 2 threads."""
    torch.manual_seed(8)
    layer = _randomize(InvertedAttentionFC(40, 5, 8, 16, 3))
    u, gp, gr = torch.randn(7, 40, 8), torch.randn(7, 5, 16), torch.randn(7, 40, 5)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_run(layer, True, u, None, 3, gp, gr))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("matrix", [False, True])
@pytest.mark.parametrize("with_parent", [False, True])
def test_gradcheck_of_every_input(ext, with_parent, matrix):
    """Finite differences for u, W, γ, β (and the starting poses), through both outputs p and r; vector poses
    (3 → 4) and 2×2 matrix poses (weight rows [I, J, 2, 4])."""
    torch.manual_seed(7)
    u_shape, w_shape = ((2, 5, 4), (5, 3, 2, 4)) if matrix else ((2, 5, 3), (5, 3, 3, 4))
    shapes = [u_shape, w_shape, (4,), (4,)] + ([(2, 3, 4)] if with_parent else [])
    inputs = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]

    def fn(u, w, gamma, beta, parent=None):
        p, r, _, _ = torch.ops.capsnet.inverted_attention_cpu(u, w, gamma, beta, parent, 3, 0.8, 1e-5, matrix)
        return p, r

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_bf16_autocast_routes_in_fp32(ext):
    torch.manual_seed(6)
    layer = InvertedAttentionFC(64, 10, 8, 16, 3)
    u = torch.randn(4, 64, 8)
    expected = layer(u)
    u_bf16 = u.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = layer(u_bf16)
    assert p.dtype == torch.float32 and (p - expected).abs().max().item() < 5e-2
    p.sum().backward()
    assert u_bf16.grad.dtype == torch.bfloat16 and torch.isfinite(u_bf16.grad).all()
    assert layer.weight.grad.dtype == torch.float32


def test_fallback_without_the_extension():
    code = (
        "import torch, warnings\n"
        "warnings.simplefilter('error')\n"
        "from capsnet.routing import InvertedAttentionFC\n"
        "from capsnet.routing import inverted_attention as ia\n"
        "assert not ia.ia_cpu.available()\n"
        "calls = []\n"
        "orig = ia.inverted_attention_step\n"
        "ia.inverted_attention_step = lambda *a, **k: calls.append(1) or orig(*a, **k)\n"
        "layer = InvertedAttentionFC(6, 3, 4, 5, 3).double()\n"
        "u = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)\n"
        "layer(u).sum().backward()\n"
        "assert len(calls) == 3 and u.grad is not None\n"
        "print('ok')\n"
    )
    assert run_without_extensions(code).strip().endswith("ok")
