"""Homogeneous vector capsules against a float64 NumPy transcription, written for this test, of the authors' op
(AdamByerly/BMCNNwHFCs, python/models/nn_ops.py `hvc_from_xyz` + `batch_norm`): x [B, 1, N, D] times W [M, N, D],
summed over the N input capsules, batch-normalised over every axis but the last (batch and output capsules) with a
shift β and no scale, ε 1e-3, then ReLU; moving statistics m ← 0.9997 m + 0.0003 (batch mean, biased variance)."""

import numpy as np
import torch

from capsnet.models.hvc_capsnet import HomogeneousVectorCapsules


def their_hvc(x, w, beta, eps=1e-3):
    s = np.sum(x[:, None, :, :] * w[None], axis=2)  # [B, M, D]
    mean, var = s.mean(axis=(0, 1)), s.var(axis=(0, 1))  # tf.nn.moments: the biased variance
    return np.maximum((s - mean) / np.sqrt(var + eps) + beta, 0), mean, var


def test_hvc_layer_is_their_hvc_op_in_training():
    rng = np.random.default_rng(0)
    layer = HomogeneousVectorCapsules(6, 4, 3, momentum=0.0003).double().train()
    with torch.no_grad():
        layer.norm.beta.normal_(0, 0.5)
    x = rng.normal(size=(5, 6, 3))
    got = layer(torch.from_numpy(x))
    want, mean, var = their_hvc(x, layer.weight.detach().numpy(), layer.norm.beta.detach().numpy())
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-10, atol=1e-12)
    # moving statistics from 0 / 1: the mean as theirs; the variance PyTorch's unbiased one, ×n/(n − 1), n = B·M
    np.testing.assert_allclose(layer.norm.running_mean.numpy(), 0.0003 * mean, rtol=1e-10)
    n = 5 * 4
    np.testing.assert_allclose(layer.norm.running_var.numpy(), 0.9997 + 0.0003 * var * n / (n - 1), rtol=1e-10)
