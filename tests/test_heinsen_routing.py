"""Heinsen's routings (capsnet.routing.heinsen, capsnet.routing.heinsen_vector): float64 NumPy transcriptions of the
papers' Algorithm 1, written for this test, one image and one input at a time; invariants; gradients; masks; a
sequence of 10,000 vectors. The comparison with the authors' own code is tests/test_heinsen_authors.py."""

import numpy as np
import pytest
import torch

from capsnet.routing.base import RoutingLayer, RoutingOutput
from capsnet.routing.heinsen import HeinsenRouting
from capsnet.routing.heinsen_vector import HeinsenVectorRouting


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def transcribed_2019(p_in, mu_in, w, b, beta_use, beta_ign, iterations, eps=1e-5):
    """One sample of the 2019 Algorithm 1 (Gaussian): p_in [I], mu_in [I, rows, c] -> a_out [J], mu [J, rows, h]."""
    n_in, n_out = len(p_in), w.shape[1]
    v = np.array([[mu_in[i] @ w[i if len(w) > 1 else 0, j] + b[i if len(b) > 1 else 0, j] for j in range(n_out)]
                  for i in range(n_in)])  # fmt: skip
    r = np.full((n_in, n_out), 1.0 / n_out)
    a_out = mu = sig2 = np.zeros(0)
    for it in range(iterations):
        if it > 0:
            for i in range(n_in):
                log_p = [-((v[i, j] - mu[j]) ** 2 / (2 * sig2[j])).sum() - np.log(np.sqrt(sig2[j])).sum()
                         for j in range(n_out)]  # fmt: skip
                r[i] = _softmax(np.log(_sigmoid(a_out)) + np.array(log_p))
        d_use = p_in[:, None] * r
        d_ign = p_in[:, None] - d_use
        a_out = np.array([(beta_use[:, j] * d_use[:, j]).sum() - (beta_ign[:, j] * d_ign[:, j]).sum()
                          for j in range(n_out)])  # fmt: skip
        mu = np.array([(d_use[:, j, None, None] * v[:, j]).sum(0) / (d_use[:, j].sum() + eps) for j in range(n_out)])
        sig2 = np.array([(d_use[:, j, None, None] * (v[:, j] - mu[j]) ** 2).sum(0) / (d_use[:, j].sum() + eps) + eps
                         for j in range(n_out)])  # fmt: skip
    return a_out, mu, r


def transcribed_2022(x, p, iterations, mask=None):
    """One sample of the 2022 Algorithm 1 with its efficient A, F, G, S, the votes V_ij stored: x [I, d]."""
    n_in, n_out = x.shape[0], p["w_f1"].shape[0]
    xs = x / np.sqrt(n_in)
    mask = np.zeros((n_in, n_out), bool) if mask is None else mask
    f_a = np.where(mask, 0.0, _sigmoid((xs * p["w_a"]).sum(1) + p["b_a"])[:, None])
    v = np.array([[(xs[i] * p["w_f1"][j]) @ p["w_f2"] + p["b_f2"][j] for j in range(n_out)] for i in range(n_in)])

    def norm(y):
        return (y - y.mean()) / np.sqrt(y.var() + 1e-5)

    x_out = np.zeros(0)
    for it in range(iterations):
        s = np.zeros((n_in, n_out))
        if it > 0:
            pred = [(norm(x_out[j]) @ p["w_g1"]) * p["w_g2"][j] + p["b_g2"][j] for j in range(n_out)]
            s = np.log(_sigmoid(np.array([[x[i] @ pred[j] for j in range(n_out)] for i in range(n_in)]) * p["w_s"]
                                + p["b_s"]))  # fmt: skip
        r = np.array([_softmax(np.where(mask[i], -np.inf, s[i])) if not mask[i].all() else np.zeros(n_out)
                      for i in range(n_in)])  # fmt: skip
        d_use = f_a * r
        phi = p["beta_use"] * d_use - p["beta_ign"] * (f_a - d_use)
        x_out = np.einsum("ij,ijh->jh", phi, v)
    return np.array([norm(row) for row in x_out]), r


def _perturbed(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initial value (zeros make many terms vanish)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    return layer


# ------------------------------------------------------------------------------------------------ 2019
@pytest.mark.parametrize("in_caps,rows", [(5, 1), (5, 2), (-1, 2)])
def test_2019_routing_is_its_algorithm(in_caps, rows):
    torch.manual_seed(0)
    layer = _perturbed(HeinsenRouting(in_caps, 3, 2 * rows, 3 * rows, iterations=3, rows=rows).double())
    u, a = torch.randn(2, 5, 2 * rows, dtype=torch.float64), torch.rand(2, 5, dtype=torch.float64)
    out = layer(u, a, return_weights=True)
    w, b = layer.weight.detach().numpy(), layer.bias.detach().numpy()
    for n in range(2):
        betas = layer.beta_use.detach().numpy(), layer.beta_ign.detach().numpy()
        a_out, mu, r = transcribed_2019(a[n].numpy(), u[n].view(5, rows, 2).numpy(), w, b, *betas, 3)
        np.testing.assert_allclose(out.activations[n].detach().numpy(), _sigmoid(a_out), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(out.capsules[n].detach().numpy(), mu.reshape(3, -1), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(out.weights[n].detach().numpy(), r, rtol=1e-9, atol=1e-12)


def test_2019_routing_is_a_routing_layer_whose_weights_sum_to_one_and_every_parameter_learns():
    torch.manual_seed(1)
    layer = HeinsenRouting(12, 4, 8, 16)
    assert isinstance(layer, RoutingLayer) and layer.iterations == 3
    u = torch.randn(3, 12, 8, requires_grad=True)
    out = layer(u, torch.rand(3, 12), return_weights=True)
    assert isinstance(out, RoutingOutput) and out.capsules.shape == (3, 4, 16) and out.activations.shape == (3, 4)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(3, 12))
    assert ((out.activations > 0) & (out.activations < 1)).all()
    (out.capsules.square().sum() + out.activations.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in layer.parameters())  # fmt: skip
    assert torch.isfinite(u.grad).all()


def test_2019_routing_gradcheck_and_absent_children():
    torch.manual_seed(2)
    layer = _perturbed(HeinsenRouting(4, 2, 3, 2, iterations=2).double())
    u = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    a = torch.rand(1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda u, a: layer(u, a, return_weights=True).activations, (u, a))
    assert torch.autograd.gradcheck(lambda u, a: layer(u, a), (u, a))
    out = layer(u, torch.zeros(1, 4, dtype=torch.float64), return_weights=True)  # no child present: no NaN
    assert torch.isfinite(out.capsules).all() and torch.isfinite(out.activations).all()


def test_2019_shared_weights_route_any_number_of_children_in_any_order():
    torch.manual_seed(3)
    layer = _perturbed(HeinsenRouting(-1, 3, 4, 4, rows=2).double())
    assert layer.weight.shape == (1, 3, 2, 2)
    u, a = torch.randn(2, 9, 4, dtype=torch.float64), torch.rand(2, 9, dtype=torch.float64)
    perm = torch.randperm(9)
    out, shuffled = layer(u, a, return_weights=True), layer(u[:, perm], a[:, perm], return_weights=True)
    torch.testing.assert_close(out.capsules, shuffled.capsules)
    torch.testing.assert_close(out.activations, shuffled.activations)
    assert layer(u[:, :4], a[:, :4]).shape == (2, 3, 4)


def test_2019_options_single_beta_and_soft_k_means():
    layer = HeinsenRouting(5, 3, 4, 4, single_beta=True)
    assert layer.beta_ign is layer.beta_use and len(list(layer.parameters())) == 3
    skm = HeinsenRouting(5, 3, 4, 4, p_model="skm")
    out = skm(torch.randn(2, 5, 4), torch.rand(2, 5), return_weights=True)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 5))
    for bad, message in [({"out_caps": 1}, "at least 2"), ({"rows": 3}, "multiples of rows"),
                         ({"p_model": "em"}, "p_model"), ({"in_caps": 0}, "in_caps")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            HeinsenRouting(**{"in_caps": 5, "out_caps": 3, "in_d": 4, "out_d": 4, **bad})
    with pytest.raises(ValueError, match=r"\[B, 5, 4\]"):
        layer(torch.randn(2, 6, 4))


# ------------------------------------------------------------------------------------------------ 2022
@pytest.mark.parametrize("in_caps,masked", [(6, False), (6, True), (-1, True)])
def test_2022_routing_is_its_algorithm(in_caps, masked):
    torch.manual_seed(4)
    layer = _perturbed(HeinsenVectorRouting(in_caps, 3, 4, 5, iterations=3).double())
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    mask = torch.rand(6, 3, generator=torch.Generator().manual_seed(0)) < 0.4 if masked else None
    if mask is not None:
        mask[1] = True  # an input no output sees
    out = layer(x, mask=mask, return_weights=True)
    p = {k: v.detach().numpy() for k, v in layer.named_parameters()}
    for n in range(2):
        if in_caps == -1:  # β from each input vector
            p["beta_use"] = layer.beta_use_net(x[n]).detach().numpy()
            p["beta_ign"] = layer.beta_ign_net(x[n]).detach().numpy()
        want, r = transcribed_2022(x[n].numpy(), p, 3, None if mask is None else mask.numpy())
        np.testing.assert_allclose(out.capsules[n].detach().numpy(), want, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(out.weights[n].detach().numpy(), r, rtol=1e-9, atol=1e-12)


def test_2022_routing_weights_sum_to_one_over_the_outputs_that_see_each_input_and_every_parameter_learns():
    torch.manual_seed(5)
    layer = HeinsenVectorRouting(7, 4, 6, 8)
    assert isinstance(layer, RoutingLayer) and layer.iterations == 2
    x = torch.randn(3, 7, 6, requires_grad=True)
    mask = torch.zeros(7, 4, dtype=torch.bool)
    mask[0, :2] = True
    out = layer(x, mask=mask, return_weights=True)
    assert out.capsules.shape == (3, 4, 8) and out.activations is None
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(3, 7))
    assert (out.weights[:, 0, :2] == 0).all()
    torch.testing.assert_close(out.capsules.mean(-1), torch.zeros(3, 4), atol=1e-6, rtol=0)  # N(x_j): mean 0
    out.capsules.square().mul(torch.randn(3, 4, 8)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert torch.isfinite(x.grad).all()


def test_2022_routing_gradcheck():
    torch.manual_seed(6)
    layer = _perturbed(HeinsenVectorRouting(-1, 2, 3, 2).double())
    x = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, False], [True, False], [False, True], [True, True]])
    assert torch.autograd.gradcheck(lambda x: layer(x, mask=mask), (x,))


def test_2022_inputs_that_every_output_ignores_change_nothing():
    """A padded sequence: the padding's values never reach the outputs (nor get a gradient)."""
    torch.manual_seed(7)
    layer = _perturbed(HeinsenVectorRouting(-1, 3, 4, 4).double())
    x = torch.randn(2, 10, 4, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 10, 1, dtype=torch.bool)
    pad[0, 6:], pad[1, 8:] = True, True  # lengths 6 and 8
    out = layer(x, mask=pad)
    other = x.detach().clone()
    other[pad.squeeze(-1)] = 1e3 * torch.randn(int(pad.sum()), 4, dtype=torch.float64)
    torch.testing.assert_close(layer(other, mask=pad), out, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert (x.grad[pad.squeeze(-1)] == 0).all() and torch.isfinite(x.grad).all()


def test_2022_routes_a_sequence_of_10000_vectors_on_the_cpu():
    """The README's sequence use: 10,000 input vectors of any length (in_caps −1), a padding mask, forward and
    backward in float32. (Its time and peak memory: benchmarks/bench_heinsen.py, docs/benchmarks.md.)"""
    torch.manual_seed(8)
    layer = HeinsenVectorRouting(-1, 32, 64, 64)
    x = torch.randn(1, 10_000, 64, requires_grad=True)
    pad = torch.zeros(1, 10_000, 1, dtype=torch.bool)
    pad[:, 9_000:] = True
    out = layer(x, mask=pad, return_weights=True)
    assert out.capsules.shape == (1, 32, 64) and torch.isfinite(out.capsules).all()
    assert (out.weights[0, 9_000:] == 0).all()
    torch.testing.assert_close(out.weights[0, :9_000].sum(-1), torch.ones(9_000))
    out.capsules.square().mul(torch.randn(1, 32, 64)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[0, 9_000:] == 0).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_2022_bad_inputs_and_sizes_are_one_clear_error():
    layer = HeinsenVectorRouting(5, 3, 4, 4)
    for args, kwargs, message in [((torch.randn(2, 6, 4),), {}, "expects 5 inputs"),
                                  ((torch.randn(2, 5, 3),), {}, r"\[B, I, 4\]"),
                                  ((torch.randn(2, 5, 4),), {"mask": torch.zeros(5, 3)}, "must be bool"),
                                  ((torch.randn(2, 5, 4),), {"mask": torch.zeros(4, 3, dtype=torch.bool)},
                                   "does not broadcast")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            layer(*args, **kwargs)
    with pytest.raises(ValueError, match="at least 2"):
        HeinsenVectorRouting(5, 1, 4, 4)
    assert not hasattr(HeinsenVectorRouting(-1, 3, 4, 4), "beta_use")  # any length: β from each input


@pytest.mark.parametrize("layer", [HeinsenRouting(6, 3, 4, 8), HeinsenVectorRouting(6, 3, 4, 8)], ids=["2019", "2022"])
def test_both_route_in_float32_under_bf16_autocast(layer):
    torch.manual_seed(9)
    u = torch.randn(2, 6, 4)
    want = layer(u)
    u16 = u.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(u16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # (only the input was rounded to bf16)
    got.sum().backward()
    assert u16.grad.dtype == torch.bfloat16 and torch.isfinite(u16.grad.float()).all()
