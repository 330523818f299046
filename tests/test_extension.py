"""capsnet.routing.extension without a compiler: the kernels' source with the shared header spliced in, extension
names that change with any source file, the lazy loader's fallback (one warning) and CAPSNET_NO_EXT; no surprise
build (a fresh cache's first forward routes with PyTorch and logs one line; `capsnet build-kernels` builds)."""

import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension  # (loaded by builds only; the tests replace its load)

from capsnet.routing import extension
from capsnet.routing.extension import CSRC, LazyExtension, extension_name, extension_source

KERNELS = ("routing_cpu", "inverted_attention_cpu")


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_shared_header_is_spliced_into_each_kernel(kernel):
    raw = (CSRC / f"{kernel}.cpp").read_text()
    assert '#include "routing_common.h"' in raw
    source = extension_source(CSRC / f"{kernel}.cpp")
    assert not re.search(r'^#include "', source, flags=re.MULTILINE)
    assert (CSRC / "routing_common.h").read_text() in source
    assert source.count("exp_inplace(T* __restrict x") == 1  # one exp, from the header
    header_lines = len((CSRC / "routing_common.h").read_text().splitlines())
    assert len(source.splitlines()) == len(raw.splitlines()) - 1 + header_lines


def test_the_extension_name_changes_with_every_source_file(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)

    def names() -> tuple[str, str]:
        source = extension_source(csrc / "routing_cpu.cpp")
        return extension_name("capsnet_routing_cpu", source, "cpu model"), extension_name("p", source, None)

    first = names()
    assert first == names() and first[0].startswith("capsnet_routing_cpu_") and first[1].startswith("p_generic_")
    assert first[0].isidentifier() and first[0] != extension_name("capsnet_routing_cpu", "", "another cpu")
    with open(csrc / "routing_common.h", "a", encoding="utf-8") as f:
        f.write("// an edit of the header\n")
    second = names()
    assert second[0] != first[0] and second[1] != first[1]
    with open(csrc / "routing_cpu.cpp", "a", encoding="utf-8") as f:
        f.write("// an edit of the kernel\n")
    assert names()[0] not in (first[0], second[0])


def test_a_kernel_that_does_not_build_warns_once_and_falls_back(monkeypatch):
    monkeypatch.delenv("CAPSNET_NO_EXT", raising=False)
    calls = []

    def fail(source_path, prefix, verbose=False, *, notice=None):
        calls.append(prefix)
        raise OSError("no compiler")

    monkeypatch.setattr(extension, "build_extension", fail)
    ext = LazyExtension("routing_cpu", what="the test kernel", fallback="plain ops")
    available, _ = ext.checks()
    with pytest.warns(RuntimeWarning, match="the test kernel could not be built; using plain ops instead"):
        assert ext.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not available() and ext.load() is None  # built once: no second try, no second warning
    assert calls == ["capsnet_routing_cpu"]
    with pytest.raises(RuntimeError, match="cannot build the test kernel: OSError: no compiler"):
        ext.kernel()
    monkeypatch.setenv("CAPSNET_NO_EXT", "1")
    with pytest.raises(RuntimeError, match="disabled"):
        ext.kernel()


def test_no_ext_disables_a_kernel_without_building_it(monkeypatch):
    monkeypatch.setenv("CAPSNET_NO_EXT", "1")
    monkeypatch.setattr(extension, "build_extension", lambda *a, **k: pytest.fail("built despite CAPSNET_NO_EXT"))
    ext = LazyExtension("inverted_attention_cpu", what="k", fallback="f")
    available, applicable = ext.checks()
    assert ext.load() is None and not available() and not applicable(torch.zeros(1), torch.zeros(1))


# ------------------------------------------------------------------------------------------------ the build itself
class _Module:
    """Stands in for a compiled extension."""


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """torch's cpp_extension.load replaced by a stand-in that records PATH, edits os.environ as a build might, and fails
    for the first (-march=native) variant; ninja is found only through the `ninja` package."""
    import os
    import sys
    import types

    seen = {}
    monkeypatch.setenv("CAPSNET_EXTENSIONS", str(tmp_path / "extensions"))  # its build times are not this machine's

    def load(*, name, extra_cflags, **_):
        seen.setdefault("path", os.environ["PATH"])
        os.environ["CAPSNET_TEST_BUILD_VAR"] = "set by the build"
        os.environ["PATH"] = "/changed/by/the/build"
        if "-march=native" in extra_cflags:
            raise RuntimeError("no -march=native here")
        seen["name"] = name
        return _Module()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(extension.shutil, "which", lambda _: None)
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR="/the/ninja/bin"))
    return seen


def test_a_build_prints_one_notice_and_leaves_the_environment_as_it_was(fake_compiler, monkeypatch, capsys):
    import os

    monkeypatch.setattr(extension, "is_built", lambda name: False)
    before = dict(os.environ)
    module = extension.build_extension(CSRC / "routing_cpu.cpp", "capsnet_test", notice="the test kernel")
    assert isinstance(module, _Module) and fake_compiler["name"].startswith("capsnet_test_generic_")
    assert fake_compiler["path"].startswith("/the/ninja/bin" + os.pathsep)  # ninja was on PATH during the build
    assert dict(os.environ) == before  # PATH restored, the build's own variable gone
    (line,) = capsys.readouterr().err.splitlines()  # one line, though the first flags failed and two were tried
    assert line.startswith("capsnet: compiling the test kernel into ") and "every later process loads it" in line
    assert str(extension.extensions_root()) in line


def test_a_cached_build_prints_no_notice(fake_compiler, monkeypatch, capsys):
    monkeypatch.setattr(extension, "is_built", lambda name: True)
    extension.build_extension(CSRC / "routing_cpu.cpp", "capsnet_test", notice="the test kernel")
    assert capsys.readouterr().err == ""


def test_a_failed_build_leaves_the_environment_as_it_was(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv("CAPSNET_EXTENSIONS", str(tmp_path))  # (not this machine's cache)

    def load(**_):
        os.environ["PATH"] = "/changed"
        raise OSError("no compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="no compiler"):
        extension.build_extension(CSRC / "routing_cpu.cpp", "capsnet_test")
    assert dict(os.environ) == before


def test_the_build_key_names_torch_python_and_the_compiler_and_changes_the_name():
    key = extension.build_key()
    assert key["torch"] == torch.__version__ and key["flavour"] in ("cpu", f"cuda{torch.version.cuda}")
    assert set(key) == {"torch", "flavour", "install", "python", "compiler"} and all(key.values())
    assert key["install"] == str(Path(torch.__file__).parent)
    names = {
        extension_name("p", "source", "cpu", key),
        extension_name("p", "source", "cpu", {**key, "torch": "2.99.0"}),
        extension_name("p", "source", "cpu", {**key, "python": "cpython-399"}),
        extension_name("p", "source", "cpu", {**key, "compiler": "clang 99"}),
        extension_name("p", "source", "cpu", {**key, "flavour": "cuda99.0"}),
        extension_name("p", "source", "cpu", {**key, "install": "/another/venv/torch"}),
    }
    assert len(names) == 6


def test_the_notice_quotes_this_machines_last_build(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPSNET_EXTENSIONS", str(tmp_path))
    first = extension.build_notice("the kernel", "capsnet_k", tmp_path / "capsnet_k_0")
    assert extension.TYPICAL_BUILD in first and str(tmp_path / "capsnet_k_0") in first
    extension._record_build_s("capsnet_k", 41.26)
    assert "the last build here took 41 s" in extension.build_notice("the kernel", "capsnet_k", tmp_path)


# The tiny kernel: a module of one function, twice(n) = 2n, on Python's C API alone. Without torch's headers it builds
# in about a second, where `#include <torch/extension.h>` alone takes 35-45 s here.
TINY = """#include <Python.h>
static PyObject* twice(PyObject*, PyObject* n) { return PyLong_FromLong(2 * PyLong_AsLong(n)); }
static PyMethodDef methods[] = {{"twice", twice, METH_O, nullptr}, {nullptr, nullptr, 0, nullptr}};
#define TEXT(x) #x
#define NAME(x) TEXT(x)
static PyModuleDef tiny = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};
#define INIT(x) PyInit_##x
#define INIT_OF(x) INIT(x)
PyMODINIT_FUNC INIT_OF(TORCH_EXTENSION_NAME)() { return PyModule_Create(&tiny); }
"""


# A first build in a fresh interpreter: it asserts that os.environ is as before the build (after `import capsnet`:
# torch's own import-time settings aside).
FIRST_BUILD = """
import os, sys
from pathlib import Path
from capsnet.routing import extension
before = dict(os.environ)
module = extension.build_extension(Path(sys.argv[1]), "capsnet_tiny", notice="the tiny kernel")
assert module.twice(21) == 42
assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
"""


@pytest.mark.slow
def test_the_first_build_prints_exactly_one_line_and_keeps_os_environ(tmp_path):
    """A real build (a tiny kernel: the routing kernels' own builds are tests/test_routing_cpu.py's and
    tests/test_inverted_attention_cpu.py's) in an empty cache, in a fresh interpreter: one notice line on stderr,
    nothing else (no compiler or ninja output), and os.environ as it was."""
    import os
    import subprocess
    import sys

    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    env = {k: v for k, v in os.environ.items() if k != "CAPSNET_NO_EXT"}
    env["CAPSNET_EXTENSIONS"] = str(tmp_path / "ext")
    r = subprocess.run(
        [sys.executable, "-c", FIRST_BUILD, str(source)], capture_output=True, text=True, timeout=900, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("capsnet: compiling the tiny kernel"), lines


def test_two_build_keys_keep_two_builds_and_each_is_found_without_compiling(monkeypatch, tmp_path, capsys):
    """Two venvs (here: two torch versions in the key) alternating on one machine: each build has its folder, and
    loading either again compiles nothing (no notice line). torch's cpp_extension.load is a stand-in that writes the
    module file where a build puts it (a real build: test_the_first_build_prints_exactly_one_line_...)."""
    monkeypatch.setenv("CAPSNET_EXTENSIONS", str(tmp_path / "ext"))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    monkeypatch.setattr(extension, "_cpu_model", lambda: "this cpu")

    def load(*, name, build_directory, **_):
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return _Module()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    keys = [{**extension.build_key(), "torch": version} for version in ("2.13.0", "2.99.0")]
    for key in keys:
        assert isinstance(extension.build_extension(source, "capsnet_tiny", notice="the tiny kernel", key=key), _Module)
    assert capsys.readouterr().err.count("capsnet: compiling the tiny kernel") == 2
    built = sorted(p.name for p in (tmp_path / "ext").iterdir() if p.is_dir() and extension.is_built(p.name))
    assert len(built) == 2 and built == sorted(extension_name("capsnet_tiny", TINY, "this cpu", key) for key in keys)
    for key in keys:  # found again without compiling, in either order
        assert extension.is_built(extension_name("capsnet_tiny", TINY, "this cpu", key))
        extension.build_extension(source, "capsnet_tiny", notice="the tiny kernel", key=key)
    assert "compiling" not in capsys.readouterr().err
