"""The routing backend switch (capsnet.routing.set_backend): global, per block, per model and per layer; "torch" never
builds or runs a C++ kernel, "cpp" refuses to fall back, CAPSNET_NO_EXT turns "auto" into "torch"."""

import pytest
import torch
from helpers import small_config

from capsnet import CapsNet, Router, squash
from capsnet.errors import ConfigError
from capsnet.routing import backend, dynamic_cpu, extension, get_backend, set_backend, use_backend
from capsnet.routing.extension import LazyExtension


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the fused dynamic-routing kernel (the real one still runs)."""
    calls = []
    real = dynamic_cpu.cpu_dynamic_routing

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dynamic_cpu, "cpu_dynamic_routing", counted)
    monkeypatch.delenv("CAPSNET_NO_EXT", raising=False)
    return calls


def _route(router: Router) -> torch.Tensor:
    torch.manual_seed(3)
    return router(squash(torch.randn(2, router.in_caps, router.in_d)))


def test_the_default_is_auto_and_an_unknown_name_is_refused():
    assert get_backend() == "auto" and backend.BACKENDS == ("auto", "cpp", "torch", "triton")
    with pytest.raises(ConfigError, match="unknown routing backend 'c'; known: auto, cpp, torch"):
        set_backend("c")
    with pytest.raises(ConfigError, match="unknown routing backend"):
        Router(8, 2, 4, 4).backend = "gpu"
    assert get_backend() == "auto"


def test_torch_never_runs_the_kernel_and_gives_the_same_result(kernel_calls):
    router = Router(32, 4, 8, 6)
    with use_backend("torch"):
        assert get_backend() == "torch"
        v_torch = _route(router)
    assert kernel_calls == [] and get_backend() == "auto"
    v_auto = _route(router)
    assert len(kernel_calls) == (1 if dynamic_cpu.available() else 0)
    torch.testing.assert_close(v_torch, v_auto, rtol=1e-5, atol=1e-6)


def test_use_backend_restores_the_previous_choice_after_an_error():
    set_backend("torch")
    try:
        with pytest.raises(KeyError), use_backend("cpp"):
            raise KeyError
        assert get_backend() == "torch"
    finally:
        set_backend("auto")


def test_a_layer_or_a_model_can_choose_its_own_backend(kernel_calls):
    router = Router(32, 4, 8, 6)
    router.backend = "torch"
    _route(router)
    assert kernel_calls == [] and get_backend() == "auto"
    model = CapsNet(config=small_config(routing="dynamic"))
    set_backend("torch", model=model)
    assert [layer.backend for layer in backend.kernel_layers(model)] == ["torch"]
    with use_backend("auto", model=model):
        assert model.class_caps.backend == "auto"
    assert model.class_caps.backend == "torch"
    model(torch.rand(2, 1, 28, 28))
    assert kernel_calls == []
    inverted = CapsNet(config=small_config(routing="inverted-attention"))
    assert len(backend.kernel_layers(inverted)) == 1  # the inverted-attention layer has a kernel too


def test_no_ext_makes_auto_mean_torch_and_cpp_an_error(monkeypatch, kernel_calls):
    monkeypatch.setenv("CAPSNET_NO_EXT", "1")
    assert backend.resolve() == "torch" and backend.resolve("cpp") == "cpp"
    _route(Router(32, 4, 8, 6))
    assert kernel_calls == []
    router = Router(32, 4, 8, 6)
    router.backend = "cpp"
    with pytest.raises(RuntimeError, match=r"disabled \(CAPSNET_NO_EXT\)"):
        _route(router)


def test_cpp_raises_where_auto_falls_back(monkeypatch):
    monkeypatch.delenv("CAPSNET_NO_EXT", raising=False)

    def fail(*args, **kwargs):
        raise OSError("no compiler")

    monkeypatch.setattr(extension, "build_extension", fail)
    ext = LazyExtension("routing_cpu", what="the test kernel", fallback="plain ops")
    _, applicable = ext.checks()
    u = torch.zeros(1, 2, 2)
    assert not applicable(u, u, "torch")
    with pytest.raises(RuntimeError, match="cannot build the test kernel: OSError: no compiler"):
        applicable(u, u, "cpp")
    fresh = LazyExtension("routing_cpu", what="the test kernel", fallback="plain ops")
    monkeypatch.setattr(fresh, "built", lambda: False)
    assert not fresh.checks()[1](u, u, "auto")  # "auto" never compiles: PyTorch until the kernel is built
    assert not applicable(u.to("meta"), u, "cpp")  # the kernels are CPU-only: other devices use PyTorch
