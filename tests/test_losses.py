import math

import pytest
import torch

from capsnet import MarginLoss, reconstruction_loss


def _caps(lengths):
    """Capsules whose lengths are `lengths` [B, n]."""
    lengths = torch.tensor(lengths, dtype=torch.float64)
    v = torch.zeros(*lengths.shape, 4, dtype=torch.float64)
    v[..., 0] = lengths
    return v


def test_margin_loss_hand_computed_class_indices():
    v = _caps([[0.95, 0.05, 0.5], [0.2, 0.8, 0.1]])
    labels = torch.tensor([0, 2])
    loss = MarginLoss(n_labels=3)(v, labels)
    # sample 0: label 0 present with |v|=0.95 >= 0.9 -> 0; absent 0.05 < 0.1 -> 0; absent 0.5 -> 0.5*(0.4)^2
    s0 = 0.5 * 0.4**2
    # sample 1: label 2 present |v|=0.1 -> (0.8)^2; absent 0.2 -> 0.5*0.1^2; absent 0.8 -> 0.5*0.7^2
    s1 = 0.8**2 + 0.5 * 0.1**2 + 0.5 * 0.7**2
    assert math.isclose(loss.item(), (s0 + s1) / 2, rel_tol=1e-12)


def test_margin_loss_hand_computed_multi_hot():
    v = _caps([[0.5, 0.95, 0.3]])
    targets = torch.tensor([[1.0, 1.0, 0.0]])
    loss = MarginLoss(n_labels=3, lambda_=0.25)(v, targets)
    expected = 0.4**2 + 0.0 + 0.25 * 0.2**2
    assert math.isclose(loss.item(), expected, rel_tol=1e-12)


def test_margin_loss_uses_squares():
    # Without the squares of Eq. 4 this would be 0.8 instead of 0.64.
    loss = MarginLoss(n_labels=2)(_caps([[0.1, 0.0]]), torch.tensor([0]))
    assert math.isclose(loss.item(), 0.64, rel_tol=1e-12)


def test_margin_loss_accepts_lengths_and_one_hot_equivalence():
    v = torch.randn(8, 10, 16)
    labels = torch.randint(0, 10, (8,))
    loss = MarginLoss()
    a = loss(v, labels)
    b = loss(v.norm(dim=-1), torch.nn.functional.one_hot(labels, 10).float())
    assert torch.allclose(a, b)


def test_margin_loss_gradient_finite_for_zero_capsules():
    v = torch.zeros(2, 10, 16, requires_grad=True)
    MarginLoss()(v, torch.tensor([1, 2])).backward()
    assert torch.isfinite(v.grad).all()


def test_margin_loss_bad_shapes():
    with pytest.raises(ValueError):
        MarginLoss()(torch.randn(2, 9, 16), torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        MarginLoss()(torch.randn(2, 10, 16), torch.zeros(2, 9))


def test_reconstruction_loss_is_weighted_sum_per_image():
    x = torch.zeros(2, 1, 28, 28)
    r = torch.full((2, 1, 28, 28), 0.5)
    assert math.isclose(reconstruction_loss(r, x).item(), 0.0005 * 784 * 0.25, rel_tol=1e-6)
    assert math.isclose(reconstruction_loss(r, x, reduction="mean").item(), 0.0005 * 0.25, rel_tol=1e-6)
    with pytest.raises(ValueError):
        reconstruction_loss(r, x[:, :, :27])


def test_full_precision_raises_half_types_and_keeps_float64():
    from capsnet.nn.losses import full_precision

    for dtype, want in [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)]:  # fmt: skip
        assert full_precision(torch.ones(2, dtype=dtype)).dtype == want
