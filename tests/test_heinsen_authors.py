"""Heinsen's routings and smallNORB model against the authors' own code (glassroom/heinsen_routing, MIT), run here on
the same inputs with the same parameters copied in: outputs and gradients in float64 to 1e-6.

Their code is not part of capsnet; these tests skip unless it is found:
    CAPSNET_HEINSEN_ROUTING       a checkout of the repository at its current head (heinsen_routing/heinsen_routing.py:
                                  EfficientVectorRouting, GenerativeMatrixRouting), or the package installed
    CAPSNET_HEINSEN_ROUTING_2019  a checkout at its 2019 code (e.g. commit 16095e5: heinsen_routing.py `Routing`,
                                  models.py `SmallNORBClassifier`, smallNORB_pretrained_model_state_dict.pt)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from capsnet.models.converters import CONVERTERS
from capsnet.models.heinsen_capsnet import HeinsenCapsNet
from capsnet.routing.heinsen import HeinsenRouting
from capsnet.routing.heinsen_vector import HeinsenVectorRouting

TOL = {"rtol": 1e-6, "atol": 1e-6}
# their EfficientVectorRouting's parameter names -> capsnet's
VECTOR_NAMES = {"W_A": "w_a", "B_A": "b_a", "W_F1": "w_f1", "W_F2": "w_f2", "B_F2": "b_f2", "W_G1": "w_g1",
                "W_G2": "w_g2", "B_G2": "b_g2", "W_S": "w_s", "B_S": "b_s", "beta_use": "beta_use",
                "beta_ign": "beta_ign", "compute_beta_use.weight": "beta_use_net.weight",
                "compute_beta_use.bias": "beta_use_net.bias", "compute_beta_ign.weight": "beta_ign_net.weight",
                "compute_beta_ign.bias": "beta_ign_net.bias"}  # fmt: skip


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def theirs() -> ModuleType:
    folder = os.environ.get("CAPSNET_HEINSEN_ROUTING")
    if folder and (Path(folder) / "heinsen_routing" / "heinsen_routing.py").is_file():
        return _load("authors_heinsen_routing", Path(folder) / "heinsen_routing" / "heinsen_routing.py")
    if importlib.util.find_spec("heinsen_routing") is not None:
        return importlib.import_module("heinsen_routing")
    pytest.skip("the authors' code is absent: set CAPSNET_HEINSEN_ROUTING to a glassroom/heinsen_routing checkout")


@pytest.fixture(scope="module")
def theirs_2019() -> Path:
    folder = Path(os.environ.get("CAPSNET_HEINSEN_ROUTING_2019", "/nonexistent"))
    if not (folder / "heinsen_routing.py").is_file() or not (folder / "models.py").is_file():
        pytest.skip("the authors' 2019 code is absent: set CAPSNET_HEINSEN_ROUTING_2019 to a glassroom/"
                    "heinsen_routing checkout of 2019 (heinsen_routing.py, models.py)")  # fmt: skip
    return folder


def _their_models(folder: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Their 2019 models.py, whose `from heinsen_routing import Routing` gets their 2019 module."""
    monkeypatch.setitem(sys.modules, "heinsen_routing", _load("heinsen_routing", folder / "heinsen_routing.py"))
    return _load("authors_heinsen_models", folder / "models.py")


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter drawn anew, std 0.5 (zeros, their βs' start, would hide terms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def _assert_same_with_gradients(ours_out, their_out, ours_params, their_params, inputs) -> None:
    """Outputs equal; then the gradients of one random projection of them, for every input and parameter."""
    pairs = list(zip(ours_out, their_out, strict=True))
    for a, b in pairs:
        torch.testing.assert_close(a, b, **TOL)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(a.shape, generator=g, dtype=a.dtype) for a, _ in pairs]
    ours_loss = sum((a * w).sum() for (a, _), w in zip(pairs, weights, strict=True))
    their_loss = sum((b * w).sum() for (_, b), w in zip(pairs, weights, strict=True))
    grads = torch.autograd.grad(ours_loss, [*inputs, *ours_params])
    their_grads = torch.autograd.grad(their_loss, [*inputs, *their_params])
    for a, b in zip(grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("n_inp", [9, -1])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("memory_efficient", [True, False])
def test_vector_routing_is_their_efficient_vector_routing(theirs, n_inp, masked, memory_efficient):
    their = theirs.EfficientVectorRouting(n_inp=n_inp, n_out=4, d_inp=6, d_out=5, n_iters=3,
                                          memory_efficient=memory_efficient).double()  # fmt: skip
    _randomize(their)
    ours = HeinsenVectorRouting(n_inp, 4, 6, 5, iterations=3).double()
    ours.load_state_dict({VECTOR_NAMES[k]: v for k, v in their.state_dict().items() if k in VECTOR_NAMES})
    x = torch.randn(2, 9, 6, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:  # (every input seen by some output: theirs gives NaN for an input no output sees)
        mask = torch.rand(9, 4, generator=torch.Generator().manual_seed(2)) < 0.5
        mask[:, 0] = False
    names = [k for k, _ in their.named_parameters()]
    _assert_same_with_gradients([ours(x, mask=mask)], [their(x, mask=mask)],
                                [dict(ours.named_parameters())[VECTOR_NAMES[k]] for k in names],
                                list(their.parameters()), [x])  # fmt: skip


@pytest.mark.parametrize("n_inp", [7, -1])
@pytest.mark.parametrize("p_model", ["gaussian", "skm"])
@pytest.mark.parametrize("single_beta", [False, True])
def test_matrix_routing_is_their_generative_matrix_routing(theirs, n_inp, p_model, single_beta):
    their = theirs.GenerativeMatrixRouting(n_inp=n_inp, n_out=3, d_cov=2, d_inp=3, d_out=4, n_iters=3,
                                           single_beta=single_beta, p_model=p_model).double()  # fmt: skip
    _randomize(their)
    ours = HeinsenRouting(n_inp, 3, 6, 8, iterations=3, rows=2, single_beta=single_beta, p_model=p_model).double()
    with torch.no_grad():
        for name, theirs_name in (("weight", "W"), ("bias", "B"), ("beta_use", "beta_use"), ("beta_ign", "beta_ign")):
            getattr(ours, name).copy_(getattr(their, theirs_name))
    a = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    mu = torch.randn(2, 7, 2, 3, dtype=torch.float64, requires_grad=True)
    res = ours.route(a, mu)
    our_params = [ours.weight, ours.bias, ours.beta_use] + ([] if single_beta else [ours.beta_ign])
    _assert_same_with_gradients([res.scores, res.poses, res.variances], list(their(a, mu)), our_params,
                                list(their.parameters()), [a, mu])  # fmt: skip


def test_smallnorb_model_and_converted_weights_are_their_classifier(theirs_2019, monkeypatch):
    """Their published weights through `capsnet convert heinsen-capsnet`, in float64: the class scores and poses of
    their SmallNORBClassifier (eval mode); their parameter count; and the gradients of a random model."""
    models = _their_models(theirs_2019, monkeypatch)
    their = models.SmallNORBClassifier(n_objs=5, n_parts=64, d_chns=64)
    assert sum(p.numel() for p in their.parameters()) == sum(p.numel() for p in HeinsenCapsNet().parameters())
    weights = theirs_2019 / "smallNORB_pretrained_model_state_dict.pt"
    if weights.is_file():
        their.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        ours = CONVERTERS["heinsen-capsnet"].load(weights).double().eval()
        their = their.double().eval()
        images = torch.rand(2, 2, 96, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            out, (a, mu, _) = ours(images), their(images)
        torch.testing.assert_close(out.logits, a, **TOL)
        torch.testing.assert_close(out.capsules, mu.flatten(-2), **TOL)
    small = models.SmallNORBClassifier(n_objs=3, n_parts=4, d_chns=8).double().train()
    _randomize(small)
    ours = HeinsenCapsNet(n_classes=3, n_parts=4, conv_channels=8).double().train()
    rename = {".W": ".weight", ".B": ".bias"}
    ours.load_state_dict({next((k.replace(o, n) for o, n in rename.items() if k.startswith("routings") and
                                k.endswith(o)), k): v for k, v in small.state_dict().items()
                          if not k.endswith("CONST_one")})  # fmt: skip
    images = torch.rand(2, 2, 96, 96, dtype=torch.float64, requires_grad=True)
    out, (a, mu, _) = ours(images), small(images)
    their_params = dict(small.named_parameters())
    our_params = [dict(ours.named_parameters())[k.replace(".W", ".weight").replace(".B", ".bias")
                                                if k.startswith("routings") else k] for k in their_params]  # fmt: skip
    _assert_same_with_gradients([out.logits, out.capsules], [a, mu.flatten(-2)], our_params,
                                list(their_params.values()), [images])  # fmt: skip


def test_2019_routing_class_is_their_current_generative_matrix_routing(theirs_2019, theirs, monkeypatch):
    """Their 2019 `Routing` (the smallNORB model's) and their current GenerativeMatrixRouting compute the same."""
    old = (
        _load("heinsen_routing_2019", theirs_2019 / "heinsen_routing.py")
        .Routing(d_cov=4, d_inp=4, d_out=4, n_inp=5, n_out=3)
        .double()
    )
    new = theirs.GenerativeMatrixRouting(n_inp=5, n_out=3, d_cov=4, d_inp=4, d_out=4).double()
    _randomize(old)
    new.load_state_dict(old.state_dict())
    a, mu = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, 4, 4, dtype=torch.float64)
    for x, y in zip(old(a, mu), new(a, mu), strict=True):
        torch.testing.assert_close(x, y, **TOL)
