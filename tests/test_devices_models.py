"""Every model and routing path on each device against the same model in float64 on the CPU: loss and every
parameter's gradient. The `cuda` cases skip without a GPU (benchmarks/gpu_check.py runs them: `pytest -m cuda`);
the `cpu` cases hold the float32 paths (the C++ kernels among them) to the float64 ones."""

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet
from capsnet.models.registry import MODELS
from capsnet.routing import em_conv
from capsnet.routing.matrix_capsules import ConvCaps

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[CUDA, pytest.mark.cuda])]

# Small settings: every layer of each model, at sizes that take milliseconds (input 1×28×28, 10 classes).
MODEL_KWARGS = {
    "efficient-capsnet": {},
    "inverted-attention-capsnet": {"stem_channels": 16, "primary_types": 4, "capsule_types": (4, 4)},
    "self-routing-capsnet": {"resnet_widths": (8, 16), "resnet_blocks": 1, "primary_types": 4,
                             "capsule_types": (4,), "capsule_strides": (2,)},
    "em-capsnet": {"conv_channels": 8, "primary_types": 4, "caps1_types": 4, "caps2_types": 4, "n_classes": 10},
    "hvc-capsnet": {"channels": (4, 4, 6, 6, 6, 8, 8, 8, 8)},
    "deepcaps": {"conv_channels": 8, "cell_types": (4, 4, 4, 4), "cell_dims": (2, 4, 4, 4), "class_dim": 8,
                 "decoder_channels": (8, 4, 4)},
    "heinsen-capsnet": {"conv_channels": 8, "n_parts": 4, "n_classes": 10},
    "vb-capsnet": {"conv_channels": 8, "primary_types": 4, "caps1_types": 4, "caps2_types": 4, "n_classes": 10},
}  # fmt: skip
ENTRIES = [f"capsnet-{r}" for r in ("dynamic", "self-attention", "inverted-attention", "self-routing", "heinsen",
                                    "heinsen-vector")]  # fmt: skip
ENTRIES += list(MODEL_KWARGS)


def _model(entry: str) -> torch.nn.Module:
    """The model with random values in its zero-initialised parameters (biases, priors, self-routing's routing
    weights, EM's β): at zero some paths start uniform and pass no gradient below them."""
    torch.manual_seed(0)
    if entry.startswith("capsnet-"):
        model = CapsNet(config=small_config(routing=entry.removeprefix("capsnet-")))
    else:
        model = MODELS[entry](in_channels=1, image_size=28, **MODEL_KWARGS[entry])
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.1)
    return model


def _loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    loss, _ = model.loss(model(x, y), x, y)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def _idle_parameters(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """The parameters that no output depends on: zero gradient of a random projection of every output tensor.

    The loss alone cannot tell: a parameter the loss is invariant to, such as a bias shared by every class logit
    under softmax cross-entropy (Σ_k (p_k − y_k) = 0), has an exactly zero gradient on some CPUs and a rounding
    residue on others."""
    out = model(x, y)
    g = torch.Generator().manual_seed(2)
    tensors = [t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]
    total = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in tensors)
    named = list(model.named_parameters())
    grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
    return [name for (name, _), gr in zip(named, grads, strict=True) if gr is None or not gr.any()]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_model_loss_and_gradients_match_cpu_float64(device, entry):
    """float32 on `device` (cuDNN off: our code, not cuDNN's algorithm choice) within 1e-3 of float64 on the CPU,
    relative to the largest gradient of each parameter."""
    model = _model(entry).eval()  # no dropout, BatchNorm on its running statistics: one function on both devices
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(3, 1, 28, 28, generator=g), torch.tensor([1, 4, 7])
    reference = model.double()
    loss64, grads64 = _loss_and_grads(reference, x.double(), y)
    assert loss64.dtype == torch.float64  # (no float32 step inside a float64 model)
    assert _idle_parameters(reference, x.double(), y) == []  # every parameter takes part
    moved = model.float().to(device)
    with torch.backends.cudnn.flags(enabled=False):
        loss, grads = _loss_and_grads(moved, x.to(device), y.to(device))
    assert loss.device.type == device and torch.isfinite(loss)
    assert abs(loss.item() - loss64.item()) <= 1e-4 * max(1.0, abs(loss64.item()))
    names = [n for n, _ in moved.named_parameters()]
    for name, gr, g64 in zip(names, grads, grads64, strict=True):
        error = (gr.cpu().double() - g64).abs().max().item()
        assert error <= 1e-3 * max(1e-3, g64.abs().max().item()), (name, error)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_caps_in_chunks_on_device_matches_cpu_float64(device, monkeypatch):
    """ConvCaps routes a few images at a time (CHUNK_BYTES on CPUs, GPU_CHUNK_BYTES elsewhere): in chunks of one
    image on `device`, in float32, it gives the float64 CPU result of the whole batch in one chunk."""
    torch.manual_seed(0)
    layer = ConvCaps(2, 3, kernel_size=3, stride=2, iterations=3).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # β_u, β_a start at 0: random values test their gradients' paths too
        layer.beta_u.normal_(0, 1, generator=g)
        layer.beta_a.normal_(0, 1, generator=g)
    poses = torch.randn(4, 5, 5, 2, 16, generator=g, dtype=torch.float64)
    acts = torch.rand(4, 5, 5, 2, generator=g, dtype=torch.float64)
    probe = [torch.randn(4, 2, 2, 3, 16, generator=g), torch.randn(4, 2, 2, 3, generator=g)]

    def run(module, p, a):
        p, a = p.clone().requires_grad_(), a.clone().requires_grad_()
        out = module(p, a)
        total = sum((o * w.to(o)).sum() for o, w in zip(out, probe, strict=True))
        return [*out, *torch.autograd.grad(total, [p, a, *module.parameters()])]

    want = run(layer, poses, acts)
    u_bytes = 2 * 2 * 3 * 9 * 2 * 32 * 4  # U of one image in float32: parents × types × children × 32 values
    monkeypatch.setattr(em_conv, "CHUNK_BYTES", u_bytes)
    monkeypatch.setattr(em_conv, "GPU_CHUNK_BYTES", u_bytes)
    got = run(layer.float().to(device), poses.float().to(device), acts.float().to(device))
    for a, b in zip(got, want, strict=True):
        assert a.device.type == device and a.dtype == torch.float32
        assert (a.cpu().double() - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
