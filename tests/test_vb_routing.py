"""Variational Bayes routing: vb_routing against a literal per-parent, per-child transcription of the updates
(value and gradient), invariants, the layers (VBRoutingFC, VBConvCaps, VBClassCaps, VBNorm) and the VBCapsNet model
(parameter count, coordinates, config checks, save/load)."""

import json
import math

import pytest
import torch

from capsnet.cli import main
from capsnet.configs.vb_capsnet import VBCapsNetConfig
from capsnet.data import standins
from capsnet.data.imageaug import resolve_augment
from capsnet.errors import ConfigError
from capsnet.models.pretrained import load_pretrained
from capsnet.models.vb_capsnet import VBCapsNet, class_coordinates
from capsnet.routing.base import RoutingLayer, RoutingOutput
from capsnet.routing.matrix_capsules import field_indices
from capsnet.routing.vb import VBNorm, VBPrior, vb_routing
from capsnet.routing.vb_conv import VBClassCaps, VBConvCaps, VBPrimaryCaps
from capsnet.routing.vb_fc import VBRoutingFC
from capsnet.training.recipes import model_recipes

TINY = {"conv_channels": 8, "primary_types": 4, "caps1_types": 4, "caps2_types": 4}


def vb_reference(votes, acts, beta_u, beta_a, *, iterations, prior, child_index=None, floor=0.0):
    """The updates of the paper (§3; Bishop 2006 §10.2) written out per parent j and per child slot i, for one image:
    votes [P, J, I, D], acts [P, I], child_index [P, I] or None -> (m [P, J, D], â [P, J], R [P, J, I])."""
    n_pos, n_par, n_slot, d = votes.shape
    nu0 = d + 1.0 if prior.nu0 is None else prior.nu0
    r = [[[1.0 / n_par for _ in range(n_slot)] for _ in range(n_par)] for _ in range(n_pos)]
    for t in range(iterations):
        q = {}
        for p in range(n_pos):
            for j in range(n_par):
                w = [r[p][j][i] * acts[p, i] for i in range(n_slot)]
                r_j = sum(w)
                mu = sum(w[i] * votes[p, j, i] for i in range(n_slot)) / r_j
                scatter = sum(w[i] * (votes[p, j, i] - mu) ** 2 for i in range(n_slot))
                alpha, kappa, nu = prior.alpha0 + r_j, prior.kappa0 + r_j, nu0 + r_j
                m = r_j * mu / kappa
                inv_psi = prior.psi0 + scatter + prior.kappa0 * r_j / kappa * mu**2
                e_ln_lambda = sum(torch.digamma((nu - k) / 2) for k in range(d)) + d * math.log(2) - inv_psi.log().sum()
                q[p, j] = (alpha, kappa, nu, m, inv_psi, e_ln_lambda)
        e_ln_pi = {
            (p, j): torch.digamma(q[p, j][0]) - torch.digamma(sum(q[p, k][0] for k in range(n_par)))
            for p in range(n_pos)
            for j in range(n_par)
        }
        if t == iterations - 1:
            break
        rho = {}
        for p in range(n_pos):
            for j in range(n_par):
                _, kappa, nu, m, inv_psi, e_ln_lambda = q[p, j]
                for i in range(n_slot):
                    quad = d / kappa + nu * ((votes[p, j, i] - m) ** 2 / inv_psi).sum()
                    ln_rho = e_ln_pi[p, j] + 0.5 * e_ln_lambda - 0.5 * d * math.log(2 * math.pi) - 0.5 * quad
                    rho[p, j, i] = torch.exp(ln_rho)
        child = (lambda p, i: (p, i)) if child_index is None else (lambda p, i: int(child_index[p, i]))
        totals: dict = {}
        for (p, _, i), value in rho.items():
            totals[child(p, i)] = totals.get(child(p, i), 0.0) + value
        r = [[[rho[p, j, i] / max(totals[child(p, i)], floor) for i in range(n_slot)] for j in range(n_par)]
             for p in range(n_pos)]  # fmt: skip
    m = torch.stack([torch.stack([q[p, j][3] for j in range(n_par)]) for p in range(n_pos)])
    logits = torch.stack([
        torch.stack([
            beta_a[j] - (torch.exp(e_ln_pi[p, j]) * (0.5 * d * math.log(2 * math.pi * math.e) - 0.5 * q[p, j][5])
                         + beta_u[j])
            for j in range(n_par)
        ])
        for p in range(n_pos)
    ])  # fmt: skip
    r_out = torch.stack(
        [torch.stack([torch.stack([torch.as_tensor(x, dtype=votes.dtype) for x in row]) for row in rp]) for rp in r]
    )
    return m, logits, r_out


def _inputs(b, p, j, i, d, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    votes = (scale * torch.randn(b, p, j, i, d, generator=g, dtype=torch.float64)).requires_grad_()
    acts = (0.05 + 0.9 * torch.rand(b, p, i, generator=g, dtype=torch.float64)).requires_grad_()
    beta_u = torch.randn(j, generator=g, dtype=torch.float64).requires_grad_()
    beta_a = torch.randn(j, generator=g, dtype=torch.float64).requires_grad_()
    return votes, acts, beta_u, beta_a


# ------------------------------------------------------------------ vb_routing = the literal loops, value and gradient
@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("fields", [False, True])
def test_vb_routing_matches_the_literal_updates(iterations, fields):
    prior = VBPrior(alpha0=0.7, kappa0=1.3, nu0=6.5, psi0=0.8)
    if fields:  # 2×2 parents, K=2, stride 1 on a 3×3 grid of 2 types: children reached by 1 to 4 parents
        _, child = field_indices(3, 3, 2, 1, 2)
        p, i, options = 4, 8, {"child_index": child, "n_children": 18}
    else:
        child, p, i, options = None, 1, 7, {}
    votes, acts, beta_u, beta_a = _inputs(2, p, 3, i, 4)
    got = vb_routing(votes, acts, beta_u, beta_a, iterations=iterations, prior=prior, min_normaliser=0.0, **options)
    for b in range(2):
        want = vb_reference(votes[b], acts[b], beta_u, beta_a, iterations=iterations, prior=prior, child_index=child)
        for x, y in zip((got.poses[b], got.logits[b], got.assignments[b]), want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)
    weights = [torch.randn_like(x) for x in got]
    inputs = (votes, acts, beta_u, beta_a)
    g_got = torch.autograd.grad(sum((x * w).sum() for x, w in zip(got, weights)), inputs)
    refs = [vb_reference(votes[b], acts[b], beta_u, beta_a, iterations=iterations, prior=prior, child_index=child)
            for b in range(2)]  # fmt: skip
    total = sum((torch.stack([r[k] for r in refs]) * weights[k]).sum() for k in range(3))
    for x, y in zip(g_got, torch.autograd.grad(total, inputs), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-10)


def test_the_authors_floor_drops_a_child_far_from_every_parent():
    votes, acts, beta_u, beta_a = _inputs(1, 1, 3, 6, 16, scale=0.1)
    with torch.no_grad():  # child 5, barely active (it hardly moves the parents), votes far from every parent
        votes[0, 0, :, 5] += 5.0
        acts[0, 0, 5] = 1e-4
    floored = vb_routing(votes, acts, beta_u, beta_a, iterations=2).assignments.sum(dim=2)  # [1, 1, I]
    exact = vb_routing(votes, acts, beta_u, beta_a, iterations=2, min_normaliser=0.0).assignments.sum(dim=2)
    torch.testing.assert_close(exact, torch.ones_like(exact))
    assert floored[0, 0, 5] < 1e-6 and torch.allclose(floored[0, 0, :5], torch.ones(5, dtype=torch.float64))


def test_vb_routing_gradcheck():
    votes, acts, beta_u, beta_a = _inputs(2, 2, 2, 4, 4, seed=3)
    _, child = field_indices(2, 3, 2, 1, 1)  # 2 parents on a 2×3 grid, K=2: the middle column reached twice

    def run(*x):
        return tuple(vb_routing(*x, iterations=3, child_index=child, n_children=6, min_normaliser=0.0))

    assert torch.autograd.gradcheck(run, (votes, acts, beta_u, beta_a))


def test_vb_routing_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        vb_routing(*_inputs(1, 1, 2, 2, 4), iterations=0)


# ------------------------------------------------------------------------------------------------------ the layers
def test_fc_layer_follows_the_routing_layer_protocol():
    torch.manual_seed(0)
    layer = VBRoutingFC(12, 5, 8, 16, iterations=3)
    assert isinstance(layer, RoutingLayer) and layer.activations
    u, a = torch.randn(4, 12, 8, requires_grad=True), torch.rand(4, 12)
    out = layer(u, a, return_weights=True)
    assert isinstance(out, RoutingOutput) and out.capsules.shape == (4, 5, 16) and out.activations.shape == (4, 5)
    torch.testing.assert_close(out.weights.sum(dim=2), torch.ones(4, 12))
    assert ((out.activations > 0) & (out.activations < 1)).all()
    (out.capsules.square().sum() + out.activations.sum()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in layer.parameters())  # fmt: skip
    assert torch.equal(layer(u, a), layer(u, a, return_weights=True).capsules)
    with pytest.raises(ValueError, match=r"\[B, 12, 8\]"):
        layer(torch.randn(4, 11, 8))


def test_vb_norm_is_the_authors_batchnorm3d_and_batchnorm2d():
    """Poses [B, P, J, D] normalised per type over (batch, positions, entries) = BatchNorm3d on [B, J, D, H, W]."""
    torch.manual_seed(0)
    norm = VBNorm(3).train()
    m, logits = torch.randn(4, 6, 3, 16), torch.randn(4, 6, 3)
    got_m, got_a = norm(type("R", (), {"poses": m, "logits": logits})())
    want_m = torch.nn.BatchNorm3d(3, affine=False)(m.view(4, 2, 3, 3, 16).permute(0, 3, 4, 1, 2))
    torch.testing.assert_close(got_m.view(4, 2, 3, 3, 16).permute(0, 3, 4, 1, 2), want_m)
    want_a = torch.sigmoid(torch.nn.BatchNorm2d(3, affine=False)(logits.view(4, 2, 3, 3).permute(0, 3, 1, 2)))
    torch.testing.assert_close(got_a.view(4, 2, 3, 3).permute(0, 3, 1, 2), want_a)


def test_conv_caps_assignments_sum_to_one_over_every_parent_a_child_reaches():
    torch.manual_seed(0)
    layer = VBConvCaps(2, 3, kernel_size=3, stride=2, min_normaliser=0.0).double()
    poses, acts = torch.randn(2, 7, 7, 2, 16, dtype=torch.float64), torch.rand(2, 7, 7, 2, dtype=torch.float64)
    res, (oh, ow) = layer.route(poses, acts)
    assert (oh, ow) == (3, 3) and res.assignments.shape == (2, 9, 3, 18)
    _, child = field_indices(7, 7, 3, 2, 2)
    per_child = torch.zeros(2, 7 * 7 * 2, dtype=torch.float64)
    per_child.index_add_(1, child.reshape(-1), res.assignments.sum(dim=2).reshape(2, -1))
    reached = torch.zeros(7 * 7 * 2).index_add_(0, child.reshape(-1), torch.ones(child.numel())) > 0
    torch.testing.assert_close(per_child[:, reached], torch.ones(2, int(reached.sum()), dtype=torch.float64))


def test_layers_are_finite_with_zero_and_identical_inputs():
    layer = VBConvCaps(2, 3, kernel_size=3, stride=1)
    for poses in (torch.zeros(2, 4, 4, 2, 16), torch.ones(2, 4, 4, 2, 16)):
        m, a = layer(poses.requires_grad_(), torch.full((2, 4, 4, 2), 0.5))
        assert torch.isfinite(m).all() and torch.isfinite(a).all()
        (m.sum() + a.sum()).backward()
        assert torch.isfinite(poses.grad).all()


def test_primary_and_class_caps_shapes():
    primary = VBPrimaryCaps(6, 4)
    m, a = primary(torch.randn(3, 6, 5, 5))
    assert m.shape == (3, 5, 5, 4, 16) and a.shape == (3, 5, 5, 4) and ((a > 0) & (a < 1)).all()
    classes = VBClassCaps(4, 7, centres=torch.zeros(25, 2))
    poses, acts, res = classes(m, a)
    assert poses.shape == (3, 7, 16) and acts.shape == (3, 7) and res.assignments.shape == (3, 1, 7, 100)
    with pytest.raises(ValueError, match="built for 25 positions"):
        classes(m[:, :4, :4], a[:, :4, :4])


# ------------------------------------------------------------------------------------------------------- the model
def test_parameter_count_of_the_authors_smallnorb_network():
    model = VBCapsNet()
    # conv 2·64·25 + BN 128; primary 64·8·16 + 64·8 + BN 4·8; ConvCaps1 9·8·16·16 + 32; ConvCaps2 9·16·16·16 + 32;
    # ClassCaps 16·5·16 + 10
    assert sum(p.numel() for p in model.parameters()) == 3_200 + 128 + 8_192 + 512 + 32 + 18_464 + 36_896 + 1_290
    assert sum(p.numel() for p in model.parameters()) == 68_714


def test_every_parameter_learns_and_the_loss_is_the_cross_entropy_of_the_activations():
    torch.manual_seed(0)
    model = VBCapsNet(in_channels=1, image_size=28, n_classes=10, **TINY).train()
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 3, 5, 9])
    out = model(images, labels, return_coupling=True)
    assert out.lengths.shape == (4, 10) and ((out.lengths > 0) & (out.lengths < 1)).all()
    assert out.coupling.shape == (4, 4 * 3 * 3, 10)
    torch.testing.assert_close(out.coupling.sum(dim=2), torch.ones(4, 36))
    total, parts = model.loss(out, images, labels)
    assert set(parts) == {"cross_entropy", "total"}
    torch.testing.assert_close(total, torch.nn.functional.cross_entropy(out.lengths, labels))
    total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_coordinates_authors_positions_and_none():
    cfg = VBCapsNetConfig()  # 32×32: the class capsules read a 4×4 grid
    torch.testing.assert_close(class_coordinates(cfg), torch.full((16, 2), 0.1))
    pos = class_coordinates(VBCapsNetConfig(coordinates="positions"))
    assert pos is not None
    torch.testing.assert_close(pos[1 * 4 + 2], torch.tensor([2 / 40, 3 / 40]))  # row 1, col 2: (row+1, col+1)/10g
    assert class_coordinates(VBCapsNetConfig(coordinates="none")) is None
    assert VBCapsNet(coordinates="none").classes.centres is None


@pytest.mark.parametrize(
    "options, message",
    [({"nu0": 15.0}, "nu0 must be > 15"), ({"alpha0": 0.0}, "must be > 0"), ({"min_normaliser": -1.0}, ">= 0"),
     ({"coordinates": "grid"}, "authors, positions or none"), ({"image_size": 16}, "too small")],
)  # fmt: skip
def test_config_checks(options, message):
    with pytest.raises(ConfigError, match=message):
        VBCapsNetConfig(**options)


def test_save_and_load_strict(tmp_path):
    torch.manual_seed(0)
    model = VBCapsNet(in_channels=1, image_size=28, n_classes=10, **TINY)
    model(torch.rand(8, 1, 28, 28))  # a training pass moves the BatchNorms' running statistics
    model.eval().save_pretrained(tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    assert isinstance(loaded, VBCapsNet) and loaded.config == model.config
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(loaded(x).lengths, model(x).lengths)


def test_the_authors_input_recipe_on_smallnorb():
    """Their pipeline: random 32×32 crops of the 48×48 images (centre crops at test), standardised, no jitter."""
    assert str(resolve_augment("auto", "smallnorb", recipes=model_recipes("vb-capsnet"))) == "crop=32x32,standardize"
    assert VBCapsNet.default_lr == 1e-3


@pytest.mark.slow
def test_cli_trains_the_authors_model_on_smallnorb_files_and_evaluates_it(tmp_path, capsys):
    folder = standins.write_smallnorb(tmp_path / "n", n_train=16, n_test=8, gz=False)
    run = tmp_path / "run"
    argv = ["train", "--model", "vb-capsnet", "--dataset", str(folder), "--epochs", "1", "--batch-size", "8",
            "--device", "cpu", "--no-progress", "--no-tensorboard", "--out", str(run),
            *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]]  # fmt: skip
    assert main(argv) == 0
    model = load_pretrained(run / "last")
    assert isinstance(model, VBCapsNet) and model.config.in_channels == 2 and model.config.image_size == 32
    assert model.config.standardize and model.config.source_size == (48, 48) and model.config.n_classes == 5
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--dataset", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 8


def test_layers_route_in_float32_under_bf16_autocast():
    torch.manual_seed(0)
    layer = VBConvCaps(2, 3, kernel_size=3, stride=1).eval()
    fc = VBRoutingFC(6, 3, 4, 16).eval()
    poses, acts = torch.randn(2, 4, 4, 2, 16), torch.rand(2, 4, 4, 2)
    u = torch.randn(2, 6, 4)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        m, a = layer(poses.bfloat16(), acts.bfloat16())
        out = fc(u.bfloat16(), return_weights=True)
    assert m.dtype == a.dtype == out.capsules.dtype == out.activations.dtype == torch.float32
    torch.testing.assert_close(a, layer(poses.bfloat16().float(), acts.bfloat16().float())[1])
    torch.testing.assert_close(out.activations, fc(u.bfloat16().float(), return_weights=True).activations)


@pytest.mark.parametrize("floor", [0.0, 1e-11])
def test_the_hand_made_backward_equals_autograd_through_the_same_steps(floor):
    _, child = field_indices(4, 4, 3, 1, 2)
    votes, acts, beta_u, beta_a = _inputs(2, 4, 3, 18, 16, seed=5, scale=0.3)
    inputs = (votes, acts, beta_u, beta_a)
    runs = [vb_routing(*inputs, child_index=child, n_children=32, min_normaliser=floor, fast=fast) for fast in (1, 0)]
    weights = [torch.randn_like(x) for x in runs[0]]
    grads = [torch.autograd.grad(sum((x * w).sum() for x, w in zip(run, weights)), inputs) for run in runs]
    for x, y in zip((*runs[0], *grads[0]), (*runs[1], *grads[1]), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_the_exported_digamma_is_torchs_to_1e_9():
    """ONNX has no digamma: while a graph is exported, VB routing's ψ is the shifted asymptotic series."""
    from unittest import mock

    from capsnet.routing.vb import digamma

    x = torch.logspace(-3, 3, 4000, dtype=torch.float64)
    assert torch.equal(digamma(x), torch.digamma(x))  # eager: torch's own
    with mock.patch("torch.compiler.is_exporting", return_value=True):
        series = digamma(x)
    assert torch.allclose(series, torch.digamma(x), rtol=1e-9, atol=1e-9)
