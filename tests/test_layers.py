import pytest
import torch
from reference import procedure1

from capsnet import PrimaryCapsules, Router, Squash, squash
from capsnet.routing.dynamic import default_weight_std


# --- squash (Eq. 1) ---------------------------------------------------------------------------------
def test_squash_norm_below_one_and_direction_kept():
    s = torch.randn(1000, 16, dtype=torch.float64) * torch.logspace(-3, 2, 1000, dtype=torch.float64)[:, None]
    v = squash(s)
    norms = v.norm(dim=-1)
    assert (norms < 1).all()
    cos = torch.nn.functional.cosine_similarity(v, s, dim=-1)
    assert torch.allclose(cos, torch.ones_like(cos))


def test_squash_matches_equation_and_module():
    s = torch.randn(5, 7, 3, dtype=torch.float64)
    n = s.norm(dim=-1, keepdim=True)
    expected = n**2 / (1 + n**2) * s / n
    assert torch.allclose(squash(s, eps=0.0), expected, atol=1e-12)
    assert torch.allclose(Squash()(s), squash(s))
    # other dims
    assert torch.allclose(squash(s, dim=1), squash(s.transpose(1, 2)).transpose(1, 2))


def test_squash_short_vectors_shrink_long_ones_approach_one():
    assert squash(torch.tensor([[1e-3, 0.0]])).norm() < 1e-5
    assert squash(torch.tensor([[100.0, 0.0]])).norm() > 0.999


def test_squash_gradient_finite_at_zero():
    s = torch.zeros(3, 8, requires_grad=True)
    squash(s).sum().backward()
    assert torch.isfinite(s.grad).all()


# --- Router (Procedure 1) -----------------------------------------------------------------------------
@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
@pytest.mark.parametrize("detach_votes", [False, True])
def test_router_matches_literal_procedure1(iterations, detach_votes):
    torch.manual_seed(iterations)
    router = Router(6, 3, 4, 5, iterations=iterations, detach_votes=detach_votes, weight_std=0.5).double()
    u = squash(torch.randn(2, 6, 4, dtype=torch.float64))
    v, c = router(u, return_coupling=True)
    v_ref, c_ref = procedure1(router.weight.detach(), u, iterations)
    assert torch.allclose(v, torch.tensor(v_ref, dtype=torch.float64), atol=1e-10, rtol=0)
    assert torch.allclose(c, torch.tensor(c_ref, dtype=torch.float64), atol=1e-10, rtol=0)


def test_coupling_sums_to_one_over_parents():
    router = Router(32, 10, 8, 16)
    _, c = router(torch.randn(4, 32, 8), return_coupling=True)
    assert c.shape == (4, 32, 10)
    assert torch.allclose(c.sum(dim=2), torch.ones(4, 32), atol=1e-6)
    assert (c >= 0).all()


def test_routing_moves_coupling_towards_agreeing_parent():
    # Every child's vote for parent 0 is the same vector; votes for parent 1 point everywhere.
    router = Router(64, 2, 2, 2, iterations=1)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.eye(2)
        router.weight[:, 1] = torch.randn(64, 2, 2)
    u = torch.tensor([1.0, 0.5]).expand(1, 64, 2).contiguous()
    _, c1 = router(u, return_coupling=True)
    assert torch.allclose(c1, torch.full_like(c1, 0.5))  # the first pass couples uniformly
    router.iterations = 3
    _, c3 = router(u, return_coupling=True)
    assert c3[0, :, 0].mean() > 0.7


def test_router_weight_layout_and_labml_state_dict():
    router = Router(1152, 10, 8, 16)
    assert router.weight.shape == (1152, 10, 8, 16)
    labml_state = {"weight": torch.randn(1152, 10, 8, 16)}  # labml's Router layout
    router.load_state_dict(labml_state, strict=True)
    u = torch.randn(2, 1152, 8)
    expected = torch.einsum("ijnm,bin->bijm", labml_state["weight"], u)
    assert torch.allclose(router.votes(u), expected, atol=1e-5)


def test_router_init_is_small_and_documented():
    router = Router(1152, 10, 8, 16)
    assert abs(router.weight.std().item() - default_weight_std(1152)) < 0.002
    assert default_weight_std(1152) == pytest.approx(0.0295, abs=1e-4)


def test_labml_minimal_routing_example():
    # The "Minimal Routing Layer Setup" of labml's annotated CapsNet, with only the import changed.
    import torch

    from capsnet import Router, Squash  # noqa: F401

    # 100 lower-level capsules, each 8-dimensional
    in_caps = 100
    in_dim = 8
    # 10 higher-level capsules, each 16-dimensional
    out_caps = 10
    out_dim = 16
    # three routing iterations (as in the paper)
    router = Router(in_caps, out_caps, in_dim, out_dim, iterations=3)
    # fake input: batch of 32 samples
    x = torch.randn(32, in_caps, in_dim)
    # forward pass – returns the output capsules (shape: [32, 10, 16])
    digit_caps = router(x)
    assert digit_caps.shape == (32, 10, 16)


@pytest.mark.parametrize(
    "bad",
    [torch.randn(2, 10, 8), torch.randn(2, 100, 7), torch.randn(100, 8), torch.zeros(2, 100, 8, dtype=torch.long)],
)
def test_router_rejects_bad_input_with_shapes_in_message(bad):
    router = Router(100, 10, 8, 16)
    with pytest.raises(ValueError, match=r"\[B, 100, 8\]"):
        router(bad)


def test_router_rejects_bad_construction():
    with pytest.raises(ValueError):
        Router(10, 10, 8, 16, iterations=0)


def test_router_gradcheck():
    router = Router(5, 3, 4, 2, iterations=3, weight_std=0.5).double()
    u = squash(torch.randn(2, 5, 4, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda u, w: _route(router, u, w), (u, router.weight))


def _route(router, u, w):
    with torch.no_grad():
        router.weight.copy_(w)
    original = router.weight
    try:
        del router.weight
        router.weight = w
        return router(u)
    finally:
        del router.weight
        router.weight = original


def test_detach_votes_gives_gradient_of_last_iteration_only():
    torch.manual_seed(1)
    router = Router(6, 3, 4, 5, iterations=3, detach_votes=True, weight_std=0.5).double()
    u = squash(torch.randn(2, 6, 4, dtype=torch.float64))
    router(u).pow(2).sum().backward()
    grad = router.weight.grad.clone()
    # Reference: coupling coefficients of the last pass as constants, then s = Σ c û, v = squash(s).
    _, c_ref = procedure1(router.weight.detach(), u, 3)
    c = torch.tensor(c_ref, dtype=torch.float64)
    w = router.weight.detach().clone().requires_grad_()
    u_hat = torch.einsum("ijnm,bin->bijm", w, u)
    squash(torch.einsum("bij,bijm->bjm", c, u_hat)).pow(2).sum().backward()
    assert torch.allclose(grad, w.grad, atol=1e-10)
    # ... and differs from the paper's full backpropagation
    router.detach_votes = False
    router.weight.grad = None
    router(u).pow(2).sum().backward()
    assert not torch.allclose(grad, router.weight.grad, atol=1e-6)


# --- primary capsules ---------------------------------------------------------------------------------
def test_primary_capsules_shape_grouping_and_squash():
    layer = PrimaryCapsules(in_channels=256, n_types=32, capsule_dim=8)
    x = torch.randn(2, 256, 20, 20)
    u = layer(x)
    assert u.shape == (2, 1152, 8)
    assert (u.norm(dim=-1) < 1).all()
    # capsule (type t, row r, col c) = squash of the 8 channels t*8 .. t*8+7 at (r, c)
    y = layer.conv(x)
    t, r, c = 5, 2, 3
    expected = squash(y[:, t * 8 : (t + 1) * 8, r, c])
    assert torch.allclose(u[:, t * 36 + r * 6 + c], expected, atol=1e-6)
    assert layer.output_grid(20, 20) == (6, 6)
