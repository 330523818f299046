"""No surprise build: under "auto" a first CPU forward on a fresh kernel cache routes with PyTorch, compiles
nothing and logs one line saying how to get the kernels; a cached build is loaded; `capsnet build-kernels` (and
capsnet.routing.kernels.build_kernels) builds them, a failure being one line and exit 2."""

import logging

import pytest
import torch

from capsnet import Router, squash
from capsnet.cli import main
from capsnet.routing import InvertedAttentionFC, extension, kernels, use_backend
from capsnet.routing.extension import NOT_BUILT, LazyExtension, extension_name, extension_source


class _Module:
    """Stands in for a compiled extension."""

    __file__ = "/cache/capsnet_kernel.so"


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty kernel cache, the kernels of capsnet.routing as a new process has them (nothing tried, nothing
    logged), CAPSNET_NO_EXT unset; returns the compilations asked of the builder (a stand-in)."""
    monkeypatch.setenv("CAPSNET_EXTENSIONS", str(tmp_path / "extensions"))
    monkeypatch.delenv("CAPSNET_NO_EXT", raising=False)
    monkeypatch.setitem(extension._NOTED, "not built", False)
    for ext in kernels.KERNELS:
        monkeypatch.setattr(ext, "_tried", False)
        monkeypatch.setattr(ext, "_absent", False)
        monkeypatch.setattr(ext, "_module", None)
    calls: list[str] = []
    return calls


def _not_built_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "capsnet" and r.getMessage() == NOT_BUILT]


def test_a_fresh_caches_first_forward_builds_nothing_and_says_how_once(fresh_cache, monkeypatch, caplog):
    monkeypatch.setattr(extension, "build_extension", lambda *a, **k: pytest.fail("compiled without being asked"))
    caplog.set_level(logging.WARNING, logger="capsnet")
    router = Router(32, 4, 8, 6)
    u = squash(torch.randn(2, 32, 8))
    v_auto = router(u)
    with use_backend("torch"):
        v_torch = router(u)
    torch.testing.assert_close(v_auto, v_torch)
    attention = InvertedAttentionFC(in_caps=8, out_caps=3, in_d=4, out_d=4)
    attention(torch.randn(2, 8, 4))
    router(u)
    assert _not_built_lines(caplog) == [NOT_BUILT]  # one line per process, for both kernels
    assert "capsnet build-kernels" in NOT_BUILT
    assert not any(ext._module for ext in kernels.KERNELS)


def test_auto_loads_a_cached_build_without_a_line(fresh_cache, monkeypatch, caplog):
    ext = LazyExtension("routing_cpu", what="the test kernel", fallback="plain ops")
    name = extension_name(ext.prefix, extension_source(ext.source_path), extension._cpu_model())
    folder = extension.extensions_root() / name
    folder.mkdir(parents=True)
    (folder / f"{name}.so").write_bytes(b"")  # what is_built looks for
    assert ext.built()
    monkeypatch.setattr(extension, "build_extension", lambda *a, **k: fresh_cache.append("load") or _Module())
    caplog.set_level(logging.WARNING, logger="capsnet")
    available, applicable = ext.checks()
    assert available() and applicable(torch.zeros(1), torch.zeros(1), "auto")
    assert fresh_cache == ["load"] and not _not_built_lines(caplog)


def test_a_cached_build_that_does_not_load_warns_and_falls_back(fresh_cache, monkeypatch):
    ext = LazyExtension("routing_cpu", what="the test kernel", fallback="plain ops")
    monkeypatch.setattr(ext, "built", lambda: True)

    def fail(*args, **kwargs):
        raise OSError("a truncated .so")

    monkeypatch.setattr(extension, "build_extension", fail)
    with pytest.warns(RuntimeWarning, match="the test kernel could not be built; using plain ops instead"):
        assert not ext.usable("auto")


def test_build_kernels_compiles_what_the_cache_lacks(fresh_cache, monkeypatch, capsys):
    def build(source_path, prefix, verbose=False, *, notice=None):
        fresh_cache.append(prefix)
        return _Module()

    monkeypatch.setattr(extension, "build_extension", build)
    monkeypatch.setattr(kernels.KERNELS[1], "built", lambda: True)  # the second is in the cache
    assert main(["build-kernels"]) == 0
    assert fresh_cache == ["capsnet_routing_cpu", "capsnet_inverted_attention_cpu"]
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("the fused CPU routing kernel: compiled in ") and first.endswith(
        "(/cache/capsnet_kernel.so)"
    )
    assert second == "the fused inverted-attention CPU kernel: already built (/cache/capsnet_kernel.so)"
    assert all(ext.usable("auto") for ext in kernels.KERNELS)  # and this process uses them now


def test_a_kernel_that_does_not_build_is_one_line_and_exit_2(fresh_cache, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise OSError("no compiler\nsecond line")

    monkeypatch.setattr(extension, "build_extension", fail)
    assert main(["build-kernels"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "capsnet build-kernels: error: cannot build the fused CPU routing kernel: OSError: no compiler second line\n"
    )


def test_a_cached_build_without_native_flags_is_loaded_without_compiling_the_native_one(
    fresh_cache, monkeypatch, capsys
):
    """Where -march=native did not build, the cache holds the generic build: loading it tries no compilation."""
    import torch.utils.cpp_extension

    ext = LazyExtension("routing_cpu", what="the test kernel", fallback="plain ops")
    monkeypatch.setattr(extension, "is_built", lambda name: "_generic_" in name)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *, name, **_: fresh_cache.append(name) or _Module())
    assert ext.usable("auto")
    (name,) = fresh_cache
    assert name.startswith("capsnet_routing_cpu_generic_") and capsys.readouterr().err == ""
