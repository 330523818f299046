"""Self-routing against a float64 NumPy transcription, written for this test, of the math of the authors' layer
(coder3000/SR-CapsNet, modules.py `SelfRouting2d`), in their layout: poses [A·C, H, W] (channel a·C + c),
activations [A, H, W], children of a window ordered position-major (kernel offset · A + type), W1 [kkA, B·D, C],
W2 [kkA, B, C], b2 [kkA, B]. capsnet orders the children type-major; the weights are relabelled to match."""

import numpy as np
import pytest
import torch

from capsnet.routing.self_routing import SelfRoutingConv, SelfRoutingFC


def their_self_routing(a, pose, w1, w2, b2, k, stride):
    """One image: a [A, H, W], pose [A·C, H, W] -> (a_out [B, H', W'], pose_out [B, D, H', W'] or None); no
    padding (their class layer's padding=0)."""
    n_types, h, w = a.shape
    c_dim = pose.shape[0] // n_types
    oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
    n_out = w2.shape[1]
    a_out = np.zeros((n_out, oh, ow))
    pose_out = None if w1 is None else np.zeros((n_out, w1.shape[1] // n_out, oh, ow))
    for y in range(oh):
        for x in range(ow):
            rows, acts = [], []
            for ky in range(k):
                for kx in range(k):
                    for t in range(n_types):  # child index (ky·k + kx)·A + t
                        rows.append(pose[t * c_dim : (t + 1) * c_dim, y * stride + ky, x * stride + kx])
                        acts.append(a[t, y * stride + ky, x * stride + kx])
            u, act = np.array(rows), np.array(acts)[:, None]  # [kkA, C], [kkA, 1]
            logit = np.einsum("ijc,ic->ij", w2, u) + b2
            r = np.exp(logit - logit.max(axis=1, keepdims=True))
            r = r / r.sum(axis=1, keepdims=True)  # softmax over the parents
            ar = act * r
            a_out[:, y, x] = ar.sum(axis=0) / act.sum()
            if w1 is not None:
                votes = np.einsum("imc,ic->im", w1, u).reshape(len(u), n_out, -1)  # [kkA, B, D]
                coeff = ar / ar.sum(axis=0, keepdims=True)
                pose_out[:, :, y, x] = np.einsum("ij,ijd->jd", coeff, votes)
    return a_out, pose_out


def _to_theirs(k: int, n_types: int) -> np.ndarray:
    """capsnet's child index (type-major: t·k² + offset) -> theirs (offset·A + t)."""
    return np.array([off * n_types + t for t in range(n_types) for off in range(k * k)])


def test_class_layer_is_their_selfrouting2d_without_poses():
    """`SelfRouting2d(A, B, C, 1, kernel_size=grid, padding=0, pose_out=False)`, their class layer."""
    rng = np.random.default_rng(0)
    n_types, c_dim, side, n_out = 3, 4, 2, 5
    a = rng.uniform(0.05, 1, (2, n_types, side, side))
    pose = rng.normal(size=(2, n_types * c_dim, side, side))
    w2, b2 = rng.normal(size=(side * side * n_types, n_out, c_dim)), rng.normal(size=(side * side * n_types, n_out))
    layer = SelfRoutingFC(n_types * side * side, n_out, c_dim, 1, pose_out=False, fast=False).double()
    idx = _to_theirs(side, n_types)
    with torch.no_grad():
        layer.route_weight.copy_(torch.from_numpy(w2[idx].transpose(0, 2, 1)))
        layer.route_bias.copy_(torch.from_numpy(b2[idx]))
    u = torch.from_numpy(pose).view(2, n_types, c_dim, side, side).permute(0, 1, 3, 4, 2)  # [B, T, H, W, C]
    out = layer(u, torch.from_numpy(a), return_weights=True)
    for b in range(2):
        want, _ = their_self_routing(a[b], pose[b], None, w2, b2, side, 1)
        np.testing.assert_allclose(out.activations[b].detach().numpy(), want[:, 0, 0], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("stride", [1, 2])
def test_conv_layer_is_their_selfrouting2d_unpadded(stride):
    """`SelfRouting2d(..., pose_out=True)` with padding 0 (their conv capsule layer pads by 1; capsnet's does not)."""
    rng = np.random.default_rng(1)
    n_types, c_dim, n_out, d_out, k, side = 2, 3, 4, 2, 3, 5
    a = rng.uniform(0.05, 1, (2, n_types, side, side))
    pose = rng.normal(size=(2, n_types * c_dim, side, side))
    kka = k * k * n_types
    w1 = rng.normal(size=(kka, n_out * d_out, c_dim))
    w2, b2 = rng.normal(size=(kka, n_out, c_dim)), rng.normal(size=(kka, n_out))
    layer = SelfRoutingConv(n_types, n_out, c_dim, d_out, k, stride, fast=False).double()
    idx = _to_theirs(k, n_types)
    with torch.no_grad():  # capsnet W^pose [i, j, c, d] = their W1[i', j·D + d, c]
        layer.pose_weight.copy_(torch.from_numpy(w1[idx].reshape(kka, n_out, d_out, c_dim).transpose(0, 1, 3, 2)))
        layer.route_weight.copy_(torch.from_numpy(w2[idx].transpose(0, 2, 1)))
        layer.route_bias.copy_(torch.from_numpy(b2[idx]))
    u = torch.from_numpy(pose).view(2, n_types, c_dim, side, side).permute(0, 1, 3, 4, 2)
    got_pose, got_a = layer(u, torch.from_numpy(a))  # [B, T', H', W', D], [B, T', H', W']
    for b in range(2):
        want_a, want_pose = their_self_routing(a[b], pose[b], w1, w2, b2, k, stride)
        np.testing.assert_allclose(got_a[b].detach().numpy(), want_a, rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(got_pose[b].permute(0, 3, 1, 2).detach().numpy(), want_pose, rtol=1e-7, atol=1e-8)
