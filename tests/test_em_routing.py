"""Matrix capsules with EM routing: the layers against a literal loop reference (value and gradient), invariants,
the spread loss, the EMCapsNet model (parameter counts, save/load, CLI training) and stability over training."""

import json
import math

import pytest
import torch
from em_reference import class_caps_reference, conv_caps_reference, em_loops

from capsnet import ConfigError
from capsnet.cli import main
from capsnet.models import EMCapsNet, load_pretrained
from capsnet.models.em_capsnet import SMALL, receptive_field_centres
from capsnet.nn.losses import SpreadLoss, spread_margin
from capsnet.routing import em_conv
from capsnet.routing.em import em_routing, inverse_temperature
from capsnet.routing.em_fc import EMRoutingFC
from capsnet.routing.matrix_capsules import ClassCaps, ConvCaps, PrimaryMatrixCaps

TINY_MODEL = ["--conv-channels", "8", "--primary-types", "4", "--caps1-types", "4", "--caps2-types", "4"]


def _conv_layer(t_in=2, t_out=3, k=3, stride=2, iterations=3, seed=0):
    torch.manual_seed(seed)
    layer = ConvCaps(t_in, t_out, kernel_size=k, stride=stride, iterations=iterations).double()
    with torch.no_grad():
        layer.beta_u.normal_(0, 1)
        layer.beta_a.normal_(0, 1)
    return layer


def _capsules(b, h, t, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    poses = torch.randn(b, h, h, t, 16, generator=g, dtype=dtype).requires_grad_()
    acts = torch.rand(b, h, h, t, generator=g, dtype=dtype).requires_grad_()
    return poses, acts


def _grads(outputs, inputs):
    mu, a = outputs
    g = torch.Generator().manual_seed(5)
    target = (mu * torch.randn(mu.shape, generator=g, dtype=mu.dtype)).sum() + (a * torch.arange(a.numel(),
              dtype=a.dtype).view(a.shape) / a.numel()).sum()  # fmt: skip
    return torch.autograd.grad(target, inputs)


# ------------------------------------------------------------------ layers = literal loops, value and gradient


@pytest.mark.parametrize("stride, iterations", [(2, 3), (1, 2), (1, 1)])
def test_conv_caps_matches_loop_reference(stride, iterations):
    layer = _conv_layer(stride=stride, iterations=iterations)
    poses, acts = _capsules(2, 5, 2)
    params = [layer.weight, layer.beta_u, layer.beta_a]
    out = layer(poses, acts)
    ref = [conv_caps_reference(poses[b], acts[b], layer.weight, layer.beta_u, layer.beta_a, kernel_size=3,
                               stride=stride, iterations=iterations) for b in range(2)]  # fmt: skip
    ref = torch.stack([r[0] for r in ref]), torch.stack([r[1] for r in ref])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-6, atol=1e-7)
    assert ref[1].std() > 1e-3  # the activations differ between parents: the comparison is not vacuous
    for g, gr in zip(_grads(out, [poses, acts, *params]), _grads(ref, [poses, acts, *params])):
        torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("images_per_chunk", [1, 2])
def test_conv_caps_in_chunks_matches_loop_reference_and_em_routing(images_per_chunk, monkeypatch):
    """ConvCaps forms its votes and routes a few images at a time (routing.em_conv); batch 3 in chunks of 1 or 2
    (the last one short) gives the loop reference's values and gradients, and em_routing's on the einsum votes."""
    layer = _conv_layer(stride=2, iterations=3)
    poses, acts = _capsules(3, 5, 2)
    p, j, i = 2 * 2, 3, 9 * 2
    monkeypatch.setattr(em_conv, "CHUNK_BYTES", images_per_chunk * p * j * i * 32 * 8)  # U of n images, float64
    params = [layer.weight, layer.beta_u, layer.beta_a]
    out = layer(poses, acts)
    ref = [conv_caps_reference(poses[b], acts[b], *params, kernel_size=3, stride=2, iterations=3) for b in range(3)]
    ref = torch.stack([r[0] for r in ref]), torch.stack([r[1] for r in ref])
    for x, y in zip(out, ref):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    for g, gr in zip(_grads(out, [poses, acts, *params]), _grads(ref, [poses, acts, *params])):
        torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-7)
    # every output, R and the logits included, against em_routing on votes formed by einsum
    res, _ = layer.route(poses, acts)
    _, _, pos, child = layer.fields(poses)  # poses on a 5×5 grid
    m = poses.reshape(3, 25, 2, 4, 4)[:, pos].reshape(3, p, i, 4, 4)
    votes = torch.einsum("bpiac,jicd->bpjiad", m, layer.weight)
    a = acts.reshape(3, 25, 2)[:, pos].reshape(3, p, i)
    want = em_routing(votes, a, *params[1:], child_index=child, n_children=50)
    weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(k), dtype=x.dtype) for k, x in
               enumerate(want)]  # fmt: skip
    for x, y, w in zip(res, want, weights):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)
        gx = torch.autograd.grad((x * w).sum(), [poses, acts, *params], retain_graph=True)
        gy = torch.autograd.grad((y * w).sum(), [poses, acts, *params], retain_graph=True, allow_unused=True)
        for u, v in zip(gx, gy):
            torch.testing.assert_close(u, torch.zeros_like(u) if v is None else v, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("coordinates", [True, False])
def test_class_caps_matches_loop_reference(coordinates):
    torch.manual_seed(0)
    centres = torch.rand(9, 2, dtype=torch.float64) if coordinates else None
    layer = ClassCaps(3, 4, iterations=3, centres=centres).double()
    with torch.no_grad():
        layer.beta_u.normal_(0, 1)
        layer.beta_a.normal_(0, 1)
    poses, acts = _capsules(2, 3, 3)
    params = [layer.weight, layer.beta_u, layer.beta_a]
    res = layer(poses, acts)
    out = res.poses[:, 0], res.activations[:, 0]
    ref = [class_caps_reference(poses[b], acts[b], *params, centres, iterations=3) for b in range(2)]
    ref = torch.stack([r[0] for r in ref]), torch.stack([r[1] for r in ref])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-6, atol=1e-7)
    for g, gr in zip(_grads(out, [poses, acts, *params]), _grads(ref, [poses, acts, *params])):
        torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-7)


def em_fc_reference(u, a, weight, beta_u, beta_a, *, iterations):
    """One image through `em_loops`: every child i of u [I, d] votes W_ij u_i for every parent j, in one field."""
    n_in, n_out = weight.shape[:2]
    votes = {(0, j, i): u[i] @ weight[i, j] for i in range(n_in) for j in range(n_out)}  # V_ij = W_ij u_i  [16]
    mu, acts = em_loops(votes, {i: a[i] for i in range(n_in)}, {0: list(range(n_in))}, n_out, beta_u, beta_a,
                        iterations=iterations)  # fmt: skip
    return torch.stack([mu[0, j] for j in range(n_out)]), torch.stack([acts[0, j] for j in range(n_out)])


@pytest.mark.parametrize("iterations", [1, 3])
def test_em_routing_fc_matches_loop_reference(iterations, monkeypatch):
    import em_reference

    from capsnet.routing import em

    for module in (em, em_reference):  # without the ε of Σ_i R'_ij (each adds it in another place), to float64's
        monkeypatch.setattr(module, "_TINY" if module is em else "TINY", 0.0)
    torch.manual_seed(0)
    layer = EMRoutingFC(7, 3, 5, iterations=iterations, weight_std=0.5, min_var=5e-4).double()  # the loops' floor
    with torch.no_grad():
        layer.beta_u.normal_(0, 1)
        layer.beta_a.normal_(0, 1)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(2, 7, 5, generator=g, dtype=torch.float64).requires_grad_()
    a = torch.rand(2, 7, generator=g, dtype=torch.float64).requires_grad_()
    params = [layer.weight, layer.beta_u, layer.beta_a]
    res = layer(u, a, return_weights=True)
    out = res.capsules, res.activations
    ref = [em_fc_reference(u[b], a[b], *params, iterations=iterations) for b in range(2)]
    ref = torch.stack([r[0] for r in ref]), torch.stack([r[1] for r in ref])
    torch.testing.assert_close(out[0], ref[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(res.weights.sum(dim=2), torch.ones(2, 7, dtype=torch.float64))  # R_ij over parents
    for grad, expected in zip(_grads(out, [u, a, *params]), _grads(ref, [u, a, *params])):
        torch.testing.assert_close(grad, expected, rtol=1e-8, atol=1e-11)


def test_em_routing_fc_routes_only_to_16_pose_entries():
    with pytest.raises(ValueError, match="16 pose entries"):
        EMRoutingFC(7, 3, 5, 8)


def test_coordinate_addition_moves_the_right_vote_entries():
    """With W = 0 the votes are exactly the added coordinates: μ_j[0, 3] and μ_j[1, 3] are the (weighted) mean
    centre, every other entry 0."""
    centres = torch.tensor([[0.25, 0.75]]).double()
    layer = ClassCaps(1, 2, centres=centres).double()
    with torch.no_grad():
        layer.weight.zero_()
    res = layer(torch.randn(1, 1, 1, 1, 16).double(), torch.ones(1, 1, 1, 1).double())
    expected = torch.zeros(16, dtype=torch.float64)
    expected[3], expected[7] = 0.25, 0.75
    torch.testing.assert_close(res.poses[0, 0], expected.expand(2, 16))


# ----------------------------------------------------------------------------------------------- invariants


def test_assignments_sum_to_one_over_the_parents_each_child_reaches():
    layer = _conv_layer(stride=1)
    poses, acts = _capsules(2, 6, 2)
    res, _ = layer.route(poses, acts)  # R [B, P, J, I]
    *_, child = layer.fields(poses)  # poses on a 6×6 grid
    per_slot = res.assignments.sum(dim=2).reshape(2, -1)  # summed over the parent types  [B, P·I]
    per_child = torch.zeros(2, 6 * 6 * 2, dtype=per_slot.dtype).index_add(1, child.reshape(-1), per_slot)
    torch.testing.assert_close(per_child, torch.ones_like(per_child))  # every child is in some field (stride 1)
    # at the corner a child reaches one position; in the middle K² = 9: R spreads over the positions
    assert res.assignments.amax() <= 1.0 and res.assignments.amin() >= 0.0


def test_activations_lie_in_the_open_unit_interval():
    layer = _conv_layer(stride=1).float()
    poses, acts = _capsules(3, 5, 2, dtype=torch.float32)
    _, a = layer(poses, acts)
    assert bool(((a > 0) & (a < 1)).all())


def _finite_everywhere(layer, poses, acts):
    poses, acts = poses.detach().requires_grad_(), acts.detach().requires_grad_()
    out = layer(poses, acts)
    mu, a = (out.poses, out.activations) if hasattr(out, "poses") else out
    (mu.square().sum() + a.sum()).backward()
    tensors = [mu, a, poses.grad, acts.grad, *(p.grad for p in layer.parameters())]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_finite_with_all_zero_inputs():
    layer = _conv_layer().float()
    assert _finite_everywhere(layer, torch.zeros(2, 5, 5, 2, 16), torch.zeros(2, 5, 5, 2))


def test_finite_with_identical_votes():
    """Every child has the same pose and every slot the same W: all votes of a parent coincide, σ² → 0 (the floor)."""
    layer = _conv_layer().float()
    with torch.no_grad():
        layer.weight.copy_(layer.weight[:, :1].expand_as(layer.weight))
    poses = torch.randn(16).expand(2, 5, 5, 2, 16).contiguous()
    assert _finite_everywhere(layer, poses, torch.ones(2, 5, 5, 2))


def test_finite_with_one_child_per_parent():
    conv = ConvCaps(1, 3, kernel_size=1, stride=1)
    assert _finite_everywhere(conv, torch.randn(2, 3, 3, 1, 16), torch.rand(2, 3, 3, 1))
    assert _finite_everywhere(ClassCaps(1, 3), torch.randn(2, 1, 1, 1, 16), torch.rand(2, 1, 1, 1))


def test_same_result_at_any_batch_split():
    layer = _conv_layer(stride=2).float()
    poses, acts = _capsules(4, 5, 2, dtype=torch.float32)
    whole = layer(poses, acts)
    parts = [layer(poses[i : i + k], acts[i : i + k]) for i, k in ((0, 1), (1, 3))]
    for n in range(2):
        torch.testing.assert_close(whole[n], torch.cat([p[n] for p in parts]), rtol=1e-5, atol=1e-6)


def test_first_training_batch_centres_the_activations():
    """centre_activations: β_a moves so that each type's mean logit is 0 on the first training batch (exactly, at
    r = 1 where the logits are affine in β_a), once; not in eval mode."""
    torch.manual_seed(0)
    poses, acts = torch.randn(4, 3, 3, 2, 16), torch.rand(4, 3, 3, 2)
    layer = ClassCaps(2, 3, iterations=1, centre_activations=True)
    assert not bool(layer.beta_a_ready) and not layer.centred
    layer.eval()(poses, acts)
    assert not bool(layer.beta_a_ready) and bool((layer.beta_a == 0).all())
    res = layer.train()(poses, acts)
    assert bool(layer.beta_a_ready) and layer.centred
    torch.testing.assert_close(res.logits.mean(dim=(0, 1)), torch.zeros(3), atol=1e-4, rtol=0)
    before = layer.beta_a.clone()
    layer(poses * 2, acts)
    assert torch.equal(layer.beta_a, before)  # only the first batch


def test_inverse_temperature_schedule():
    assert [round(inverse_temperature(t), 6) for t in range(3)] == [0.0005, 0.000975, 0.001426]


def test_em_routing_rejects_zero_iterations():
    with pytest.raises(ValueError):
        em_routing(torch.zeros(1, 1, 2, 3, 16), torch.ones(1, 1, 3), torch.zeros(2), torch.zeros(2), iterations=0)


def test_primary_matrix_caps_shapes():
    caps = PrimaryMatrixCaps(8, 4)
    poses, acts = caps(torch.randn(2, 8, 5, 5))
    assert poses.shape == (2, 5, 5, 4, 16) and acts.shape == (2, 5, 5, 4)
    assert bool(((acts > 0) & (acts < 1)).all())


# ------------------------------------------------------------------------------------------------ spread loss


def test_spread_loss_matches_its_definition():
    a = torch.tensor([[0.9, 0.5, 0.85], [0.1, 0.3, 0.2]])
    labels = torch.tensor([0, 2])
    m = 0.2
    expected = 0.0
    for b in range(2):
        t = int(labels[b])
        expected += sum(max(0.0, m - (a[b, t] - a[b, i])) ** 2 for i in range(3) if i != t)
    torch.testing.assert_close(SpreadLoss(3)(a, labels, m), torch.tensor(float(expected) / 2))


def test_spread_margin_schedule():
    assert spread_margin(0.0) == pytest.approx(0.2)
    assert spread_margin(0.5) == pytest.approx(0.55)
    assert spread_margin(1.0) == spread_margin(3.0) == pytest.approx(0.9)


# ------------------------------------------------------------------------------------------------------ model


def test_parameter_counts_of_the_papers_configurations():
    """smallNORB (1 channel, 32×32, 5 classes). A=B=C=D=32:
    conv 5×5: 25·1·32 + 32 = 832; primary 1×1: poses 32·32·16 + 32·16 = 16,896, activations 32·32 + 32 = 1,056;
    ConvCaps1: 3·3·32·32·16 + 2·32 = 147,520; ConvCaps2: 147,520; class caps: 32·5·16 + 2·5 = 2,570
    -> 316,394 (the paper: "about 310K").
    A=64, B=8, C=D=16: 25·64 + 64 = 1,664; 64·8·16 + 8·16 = 8,320; 64·8 + 8 = 520; 9·8·16·16 + 32 = 18,464;
    9·16·16·16 + 32 = 36,896; 16·5·16 + 10 = 1,290 -> 67,154 (the paper: "68K")."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(EMCapsNet()) == 316_394
    assert count(EMCapsNet(**SMALL)) == 67_154


def test_receptive_field_centres_on_smallnorb_crops():
    """32 → conv 5/2 → 14 → ConvCaps 3/2 → 6 → ConvCaps 3/1 → 4: a pixel-0 centre of 0.5 moves by (k−1)/2 steps of
    the jump so far per layer (0.5 + 2·1 + 1·2 + 1·4 = 8.5), the jump is 2·2·1 = 4: 8.5 + 4y pixels, over 32."""
    c = receptive_field_centres(EMCapsNet().config)
    expected = (8.5 + 4 * torch.arange(4.0)) / 32
    torch.testing.assert_close(c.view(4, 4, 2)[:, 0, 0], expected)
    torch.testing.assert_close(c.view(4, 4, 2)[0, :, 1], expected)


def test_coordinate_addition_defaults_to_the_authors_grid_in_v03_and_v13():
    """Gritzman's fc_caps (IBM/matrix-capsules-with-em-routing, layers.coord_addition): on the 3×3 grid the class
    capsules read on 28×28 digits, (col + ½)/3 is added to pose element 3 (V[0, 3]) and (row + ½)/3 to element 7
    (V[1, 3]). With W = 0 and only the child at (row 0, col 2) active, μ_j is exactly that position's coordinates."""
    model = EMCapsNet(image_size=28, n_classes=3, conv_channels=4, primary_types=2, caps1_types=2, caps2_types=2)
    assert model.config.coordinate_style == "grid"
    sixth = 1 / 6
    expected = [[sixth, sixth], [3 * sixth, sixth], [5 * sixth, sixth],
                [sixth, 3 * sixth], [3 * sixth, 3 * sixth], [5 * sixth, 3 * sixth],
                [sixth, 5 * sixth], [3 * sixth, 5 * sixth], [5 * sixth, 5 * sixth]]  # fmt: skip
    torch.testing.assert_close(model.classes.centres, torch.tensor(expected))
    layer = model.classes.double()
    with torch.no_grad():
        layer.weight.zero_()
    acts = torch.zeros(1, 3, 3, 2, dtype=torch.float64)
    acts[0, 0, 2, 0] = 1.0
    res = layer(torch.randn(1, 3, 3, 2, 16, dtype=torch.float64), acts)
    pose = res.poses[0, 0]  # [n, 16]
    torch.testing.assert_close(pose[:, 3], torch.full((3,), 5 / 6, dtype=torch.float64))
    torch.testing.assert_close(pose[:, 7], torch.full((3,), 1 / 6, dtype=torch.float64))
    assert pose[:, [i for i in range(16) if i not in (3, 7)]].abs().max() == 0


def test_receptive_field_coordinates_are_an_option_and_old_folders_keep_them(tmp_path):
    """`coordinate_style="receptive-field"`: (row, col) of the receptive-field centres in pixels / image size into
    V[0, 3], V[1, 3] (on 28×28: 8.5 + 4y pixels). A config.json without the key loads with it."""
    small = {"image_size": 28, "n_classes": 3, "conv_channels": 4, "primary_types": 2, "caps1_types": 2,
             "caps2_types": 2}  # fmt: skip
    model = EMCapsNet(**small, coordinate_style="receptive-field")
    c = model.classes.centres.view(3, 3, 2)
    torch.testing.assert_close(c[:, 0, 0], torch.tensor([8.5, 12.5, 16.5]) / 28)  # row into V[0, 3]
    torch.testing.assert_close(c[0, :, 1], torch.tensor([8.5, 12.5, 16.5]) / 28)  # col into V[1, 3]
    torch.manual_seed(1)
    old = EMCapsNet(**small, coordinate_style="receptive-field", centre_activations=False).eval()
    old.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    del meta["config"]["coordinate_style"]
    (tmp_path / "config.json").write_text(json.dumps(meta))
    loaded = load_pretrained(tmp_path)
    assert loaded.config.coordinate_style == "receptive-field"
    x = torch.rand(2, 1, 28, 28)
    torch.testing.assert_close(loaded(x).lengths, old(x).lengths)
    with pytest.raises(ConfigError, match="coordinate_style"):
        EMCapsNet(**small, coordinate_style="pixels")


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return EMCapsNet(image_size=28, n_classes=10, conv_channels=8, primary_types=4, caps1_types=4, caps2_types=4)


@pytest.mark.slow
def test_model_output_like_capsnet(tiny_model):
    x = torch.rand(3, 1, 28, 28)
    out = tiny_model(x, return_coupling=True)
    assert out.capsules.shape == (3, 10, 16) and out.lengths.shape == (3, 10)
    assert out.predictions.tolist() == out.lengths.argmax(1).tolist() and out.reconstructions is None
    assert out.coupling.shape == (3, 4 * 3 * 3, 10)  # D · grid² children of the class capsules
    torch.testing.assert_close(out.coupling.sum(-1), torch.ones(3, 36))
    assert tiny_model(x).coupling is None
    with pytest.raises(ValueError, match="images of shape"):
        tiny_model(torch.rand(3, 1, 32, 32))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["spread", "margin", "cross_entropy"])
def test_model_losses(kind):
    torch.manual_seed(0)
    model = EMCapsNet(image_size=28, n_classes=10, conv_channels=4, primary_types=2, caps1_types=2, caps2_types=2,
                      class_loss=kind, margin_anneal_steps=4)  # fmt: skip
    x, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    steps = 5 if kind == "spread" else 1
    for step in range(steps):
        total, parts = model.loss(model(x), x, y)
        total.backward()
        assert math.isfinite(parts["total"]) and parts["total"] >= 0
        if kind == "spread":
            assert parts["spread_margin"] == pytest.approx(spread_margin(step / 4))
    model.eval()
    total, parts = model.loss(model(x), x, y)  # evaluation does not advance the margin schedule
    assert model.margin_steps == (steps if kind == "spread" else 0)
    if kind == "spread":  # and scores at the final margin, whatever the step, so validation losses compare
        assert parts["spread_margin"] == pytest.approx(0.9)
        model.margin_steps = 0
        again, _ = model.loss(model(x), x, y)
        torch.testing.assert_close(again, total)
        torch.testing.assert_close(total, SpreadLoss(10)(model(x).lengths, y, 0.9))


def test_save_and_load_strict(tiny_model, tmp_path):
    x = torch.rand(2, 1, 28, 28)
    tiny_model.eval()
    tiny_model.margin_steps += 7
    tiny_model.save_pretrained(tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    assert isinstance(loaded, EMCapsNet) and loaded.margin_steps == 7 and int(loaded.train_steps) == 7
    torch.testing.assert_close(loaded(x).lengths, tiny_model(x).lengths)


@pytest.mark.slow
def test_two_training_steps_from_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", "em-capsnet", *TINY_MODEL, "--train-subset", "32", "--test-subset", "20",
                 "--batch-size", "16", "--epochs", "1", "--device", "cpu", "--no-progress", "--no-tensorboard",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    model = load_pretrained(out / "last")
    assert isinstance(model, EMCapsNet) and model.margin_steps == 2
    assert model.config.caps2_types == 4 and model.config.image_size == 28
    assert all(layer.centred for layer in (model.caps1, model.caps2, model.classes))


def _train_steps(iterations: int, steps: int, seed: int = 0) -> list[float]:
    from capsnet.data import load_dataset

    torch.manual_seed(seed)
    data = load_dataset("mnist-sample").train
    model = EMCapsNet(image_size=28, n_classes=10, conv_channels=16, primary_types=4, caps1_types=4, caps2_types=4,
                      routing_iterations=iterations, margin_anneal_steps=steps)  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=EMCapsNet.default_lr)
    losses = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(data), (16,), generator=g)
        x, y = data.images[idx].float() / 255.0, data.labels[idx]
        loss, _ = model.loss(model(x, y), x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_training_is_stable(iterations):
    """A short version of the 200-step check below (marked slow)."""
    losses = _train_steps(iterations, 4)
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_training_is_stable_200_steps(iterations):
    losses = _train_steps(iterations, 200)
    assert all(math.isfinite(v) for v in losses)


def test_visualize_draws_the_final_assignments(tiny_model, tmp_path):
    pytest.importorskip("matplotlib")
    from capsnet.viz.routing import plot_routing

    out = plot_routing(tiny_model.eval(), torch.rand(1, 28, 28), 3, tmp_path / "routing.png")
    assert out.read_bytes().startswith(b"\x89PNG")


# ------------------------------------------------------------------- centring and the margin schedule, on the host
def test_loading_a_centred_layer_is_not_centred_again():
    """The host flag follows the saved buffer: a loaded layer that was centred is not shifted by its first training
    batch; one saved before its first batch is."""
    torch.manual_seed(0)
    poses, acts = torch.randn(4, 3, 3, 2, 16), torch.rand(4, 3, 3, 2)
    done = ClassCaps(2, 3, iterations=1, centre_activations=True).train()
    done(poses, acts)
    fresh = ClassCaps(2, 3, iterations=1, centre_activations=True)
    fresh.load_state_dict(done.state_dict())
    assert fresh.centred and torch.equal(fresh.beta_a, done.beta_a)
    fresh.train()(poses * 3, acts)
    assert torch.equal(fresh.beta_a, done.beta_a)
    unready = ClassCaps(2, 3, iterations=1, centre_activations=True)
    loaded = ClassCaps(2, 3, iterations=1, centre_activations=True)
    loaded.centred = True
    loaded.load_state_dict(unready.state_dict())
    assert not loaded.centred


def test_init_from_data_centres_every_layer_once(tiny_model):
    x = torch.rand(6, 1, 28, 28)
    layers = (tiny_model.caps1, tiny_model.caps2, tiny_model.classes)
    tiny_model.eval()
    tiny_model.init_from_data(x)
    assert all(layer.centred and bool(layer.beta_a_ready) for layer in layers) and not tiny_model.training
    assert all(layer.beta_a.abs().sum() > 0 for layer in layers)
    before = [layer.beta_a.clone() for layer in layers]
    tiny_model.init_from_data(x * 0.5)  # once only
    tiny_model.train()(x)  # and the first training batch leaves it too
    assert all(torch.equal(layer.beta_a, b) for layer, b in zip(layers, before))
    off = EMCapsNet(image_size=28, n_classes=10, conv_channels=8, primary_types=4, caps1_types=4, caps2_types=4,
                    centre_activations=False)  # fmt: skip
    off.init_from_data(x)
    assert all(bool((layer.beta_a == 0).all()) for layer in (off.caps1, off.caps2, off.classes))


def test_the_margin_schedule_counts_on_the_host_and_checkpoints_of_the_buffer_load(tiny_model):
    """margin_steps is a host int, saved as the `train_steps` buffer; a state dict written before the host counter
    existed (the buffer alone, which the model advanced on the device) restores it."""
    state = tiny_model.state_dict()
    assert int(state["train_steps"]) == 0
    state["train_steps"] = torch.tensor(7)
    for key in [k for k in state if k.endswith("beta_a_ready")]:
        state[key] = torch.tensor(True)
    old = EMCapsNet(image_size=28, n_classes=10, conv_channels=8, primary_types=4, caps1_types=4, caps2_types=4)
    old.load_state_dict(state, strict=True)
    assert old.margin_steps == 7 and old.current_margin() == pytest.approx(spread_margin(7 / 10000))
    assert all(layer.centred for layer in (old.caps1, old.caps2, old.classes))
    x, y = torch.rand(2, 1, 28, 28), torch.tensor([1, 2])
    old.train()
    old.loss(old(x), x, y)
    assert old.margin_steps == 8 and int(old.train_steps) == 7  # the buffer follows only when saved
    assert int(old.state_dict()["train_steps"]) == 8


@pytest.mark.slow
def test_training_centres_before_the_first_step_and_a_resume_does_not(tmp_path, monkeypatch):
    from capsnet.training import api, build
    from capsnet.training.config import TrainConfig
    from capsnet.training.distributed import DistInfo
    from capsnet.training.runfolder import release

    calls = []
    real = EMCapsNet.init_from_data
    monkeypatch.setattr(EMCapsNet, "init_from_data", lambda model, x: calls.append(x.shape) or real(model, x))
    config = TrainConfig(out=str(tmp_path / "run"), model="em-capsnet", train_subset=32, test_subset=16,
                         batch_size=16, epochs=1, progress=False, tensorboard=False, device="cpu")  # fmt: skip
    small = EMCapsNet.config_class(conv_channels=8, primary_types=4, caps1_types=4, caps2_types=4)
    run = build.build(config, small, torch.device("cpu"), DistInfo(), None)
    assert calls == [(16, 1, 28, 28)]  # rank 0's first batch, before any step
    assert all(layer.centred for layer in (run.model.caps1, run.model.caps2, run.model.classes))
    release(config.out)  # (a run only built, not trained: its folder's lock goes before train takes it)
    api.train(config, small)
    resumed = TrainConfig(**{**config.__dict__, "epochs": 2, "resume": True})
    calls.clear()
    api.train(resumed)
    assert calls == []


@pytest.mark.slow
def test_a_resumed_run_continues_the_margin_schedule_exactly(tmp_path):
    """Stopped after its 3rd step (mid-epoch) and resumed, a run ends with the weights and margin of one that was
    not stopped."""
    from capsnet.training import api
    from capsnet.training.config import TrainConfig

    small = EMCapsNet.config_class(conv_channels=8, primary_types=4, caps1_types=4, caps2_types=4,
                                   margin_anneal_steps=8)  # fmt: skip
    common = dict(model="em-capsnet", train_subset=64, test_subset=16, batch_size=16, epochs=2, progress=False,
                  tensorboard=False, device="cpu", lr_decay=0.5)  # fmt: skip
    api.train(TrainConfig(out=str(tmp_path / "whole"), **common), small)
    stopped = api.train(TrainConfig(out=str(tmp_path / "parts"), **common), small, on_step=lambda step: step == 3)
    assert stopped.interrupted
    assert load_pretrained(tmp_path / "parts" / "last").margin_steps == 3
    api.train(TrainConfig(out=str(tmp_path / "parts"), resume=True, **common))
    whole, parts = (load_pretrained(tmp_path / name / "last") for name in ("whole", "parts"))
    assert whole.margin_steps == parts.margin_steps == 8
    for (key, a), b in zip(whole.state_dict().items(), parts.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_em_capsnet_routes_in_float32_under_bf16_autocast(tiny_model):
    # both EM layers (conv_em_routing and em_routing) take bf16 poses from autocast and route them in float32
    torch.manual_seed(4)
    x = torch.rand(2, 1, 28, 28)
    want = tiny_model(x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tiny_model(x)[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)  # (only the convolutions ran in bf16)
    got.sum().backward()
    grads = [p.grad for p in tiny_model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
