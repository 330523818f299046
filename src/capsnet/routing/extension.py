"""The C++ CPU kernels of capsnet.routing: built on request, used once built.

Each kernel is one C++ file in ``csrc/`` (``routing_cpu.cpp``: dynamic routing; ``inverted_attention_cpu.cpp``:
inverted dot-product attention routing); the building blocks they share are in ``csrc/routing_common.h``, which is
spliced into a kernel's text in place of its ``#include "routing_common.h"`` line (`extension_source`). The
text, written to its build folder, is compiled with ``torch.utils.cpp_extension.load`` (``-O3 -march=native
-fopenmp``, or without ``-march=native`` if that fails; needs a C++ compiler and ninja) into capsnet's own cache,
one folder per build (``~/.cache/capsnet/extensions/<name>``, or under ``$CAPSNET_EXTENSIONS``;
`extensions_root`). The name carries a hash of the whole text and of the build key (`build_key`: the torch
version, its CPU/CUDA flavour, the Python ABI, the compiler and the CPU model with its instruction-set flags), so
two venvs or two torch versions on one machine never replace each other's build, a change to a kernel or its
header gets a fresh build, and a cached build is loaded without compiling.

No forward compiles without being asked (docs/benchmarks.md, "No surprise build"). A compilation happens only in
`LazyExtension.build` (``capsnet build-kernels``, `capsnet.routing.kernels.build_kernels`) or under the
"cpp" backend, which demands the kernel. Under "auto" a layer uses a kernel already in the cache (loaded, not
compiled) and otherwise its PyTorch path, after one log line per process (logger "capsnet", WARNING) saying how to
get the kernel (`NOT_BUILT`). A real compilation prints one notice line on stderr (what, where, and how long
the last build took on this machine); os.environ is left as it was. A cached build that does not load gives one
warning and the PyTorch path. Whether a layer uses its kernel is the routing backend's choice
(`capsnet.routing.backend`: "auto", "cpp" or "torch"); ``CAPSNET_NO_EXT=1`` disables the kernels.
A kernel's module (e.g. `capsnet.routing.dynamic_cpu`) exposes `build`, `load`, `available` and `applicable`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

from ..errors import KernelBuildError
from ..fileio import atomic_write_bytes, atomic_write_json
from ..logs import LOGGER
from .backend import BACKENDS
from .backend import resolve as resolve_backend

CSRC = Path(__file__).with_name("csrc")
log = logging.getLogger("capsnet")
# The line logged (once per process) when "auto" routes with PyTorch because no kernel is built yet.
NOT_BUILT = (
    "capsnet: the C++ CPU routing kernels are not built, so routing runs on its PyTorch path; "
    "`capsnet build-kernels` builds them once (about 20-60 s, needs a C++ compiler and ninja) for 4-7x faster "
    "routing on CPUs (CAPSNET_NO_EXT=1 silences this)"
)
_NOTED = {"not built": False}
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[^\n]*$', re.MULTILINE)


@contextmanager
def build_environment() -> Iterator[None]:
    """The environment a build runs in: `ninja` on PATH (torch's cpp_extension runs it from there, and the `ninja`
    pip package may sit in an inactive venv). Every change to os.environ made inside is undone afterwards."""
    saved = dict(os.environ)
    try:
        if not shutil.which("ninja"):
            try:
                import ninja  # the PyPI package ships the binary in ninja.BIN_DIR
            except ImportError:
                pass
            else:
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


# How long a first build of one kernel took on the development machine (2-core AMD EPYC, shared with other jobs;
# docs/benchmarks.md), quoted until this machine has timed a build of its own.
TYPICAL_BUILD = "20-60 s on a 2-core CPU"


def extensions_root() -> Path:
    """The folder holding capsnet's compiled kernels, one subfolder per build: `$CAPSNET_EXTENSIONS`, else
    `~/.cache/capsnet/extensions` (not under `$CAPSNET_DATA`: a data cache of its own does not rebuild them)."""
    env = os.environ.get("CAPSNET_EXTENSIONS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "capsnet" / "extensions"


def is_built(name: str) -> bool:
    """Whether capsnet's kernel cache already holds the compiled extension `name` (so loading it is quick)."""
    return any(p.suffix in (".so", ".pyd") for p in (extensions_root() / name).glob(f"{name}.*"))


@functools.cache
def compiler_id() -> str:
    """The C++ compiler torch's builds use ($CXX, else c++) and the first line of its `--version`."""
    cxx = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        version = (done.stdout or done.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        version = "unknown"
    return f"{cxx}: {version}"


def build_key() -> dict[str, str]:
    """What a compiled kernel depends on besides its source text and the CPU: torch's version and flavour (cpu,
    cudaX.Y, rocmX.Y), the folder it is installed in (its headers' path is in the build commands, so two
    environments sharing one build folder would rebuild it in turn), the Python ABI and the compiler."""
    hip = getattr(torch.version, "hip", None)
    flavour = f"cuda{torch.version.cuda}" if torch.version.cuda else (f"rocm{hip}" if hip else "cpu")
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag or platform.python_version()
    install = str(Path(torch.__file__).parent)  # (as imported, not resolved: the path the build commands name)
    return {
        "torch": str(torch.__version__),
        "flavour": flavour,
        "install": install,
        "python": str(abi),
        "compiler": compiler_id(),
    }


def _last_build_s(prefix: str) -> float | None:
    try:
        times = json.loads((extensions_root() / "build_times.json").read_text(encoding="utf-8"))
        return float(times[prefix])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_build_s(prefix: str, seconds: float) -> None:
    """Keep how long this machine took to build `prefix` (for the next notice); a cache that cannot be written
    keeps nothing."""
    path = extensions_root() / "build_times.json"
    try:
        times = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if not isinstance(times, dict):
            times = {}
        times[prefix] = round(seconds, 1)
        atomic_write_json(path, times)
    except (OSError, ValueError):
        pass


def build_notice(what: str, prefix: str, folder: Path) -> str:
    """The one line printed before a real compilation: what, where, and how long it takes here."""
    last = _last_build_s(prefix)
    took = f"the last build here took {last:.0f} s" if last is not None else f"{TYPICAL_BUILD}, less with more cores"
    return (
        f"capsnet: compiling {what} into {folder} (once per torch build and folder, Python, compiler, CPU; {took}; "
        "once built, every later process loads it)"
    )


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags (what -march=native depends on)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = {line for line in f if line.startswith(("model name", "flags", "Features"))}
    except OSError:
        lines = set()
    return "".join(sorted(lines)) or platform.processor() or platform.machine()


def extension_source(source_path: Path) -> str:
    """The text of the C++ file `source_path` with each `#include "name"` line replaced by the text of the file
    `name` beside it (one level: the headers include only system headers)."""

    def header(include: re.Match[str]) -> str:
        return (source_path.parent / include.group(1)).read_text().rstrip("\n")

    return _LOCAL_INCLUDE.sub(header, source_path.read_text())


def extension_name(prefix: str, source: str, cpu: str | None, key: Mapping[str, str] | None = None) -> str:
    """`prefix_<hash>` (`prefix_generic_<hash>` when `cpu` is None: the build without -march=native): the hash covers
    the source text, the CPU model and the build key (default: `build_key`)."""
    key = build_key() if key is None else key
    text = "\n".join([cpu or "generic", *(f"{k}={key[k]}" for k in sorted(key)), source])
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    return f"{prefix}_{digest}" if cpu is not None else f"{prefix}_generic_{digest}"


def build_extension(
    source_path: Path,
    prefix: str,
    verbose: bool = False,
    *,
    notice: str | None = None,
    key: Mapping[str, str] | None = None,
) -> ModuleType:
    """Compile the C++ file `source_path` (headers spliced in) with -march=native, else without, in its own folder
    of `extensions_root` named by `extension_name`; a build already there is loaded without compiling.
    Before a real compilation, one line on stderr names `notice` (what is built), where, and how long it takes.
    Raises RuntimeError if neither builds. os.environ is left as it was (`build_environment`)."""
    from torch.utils.cpp_extension import load

    source = extension_source(source_path)
    key = build_key() if key is None else key
    errors = []
    variants = [
        (extension_name(prefix, source, _cpu_model(), key), ["-O3", "-march=native", "-mprefer-vector-width=512"]),
        (extension_name(prefix, source, None, key), ["-O3"]),
    ]
    variants.sort(key=lambda v: not is_built(v[0]))  # a cached build first: loading it compiles nothing
    with build_environment():
        for name, flags in variants:
            folder = extensions_root() / name
            compiles = not is_built(name)
            if notice and compiles:
                LOGGER.warning(build_notice(notice, prefix, folder))
            start = time.perf_counter()
            try:
                folder.mkdir(parents=True, exist_ok=True)
                main = folder / "main.cpp"  # the text as compiled (it includes what it needs: no header is added)
                if compiles:  # (a build's own main.cpp stays as it was: ninja then finds nothing to do)
                    atomic_write_bytes(main, source.encode())
                module = load(
                    name=name,
                    sources=[str(main)],
                    extra_cflags=[*flags, "-fopenmp", "-std=c++17"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=verbose,
                )
            except Exception as e:  # compiler/flag/ninja problems: try the next flags, then give up
                errors.append(f"{name}: {type(e).__name__}: {e}")
                notice = None  # one line per kernel, even when the first flags fail
                continue
            if compiles:
                _record_build_s(prefix, time.perf_counter() - start)
            return module
    raise RuntimeError("; ".join(errors))


def assume_constant_result(fn: Callable[[], bool]) -> Callable[[], bool]:
    """`fn`, marked for torch.compile as returning a constant (`torch.compiler.assume_constant_result`), without
    importing torch._dynamo: that function sets this one attribute, and importing dynamo costs seconds."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


class LazyExtension:
    """The kernel `csrc/<name>.cpp`, built as `capsnet_<name>_…` by `build_extension` on request
    (`build`, or `load` under the "cpp" backend) and kept. `what` names it in messages ("the fused CPU
    routing kernel"), `fallback` what runs instead."""

    def __init__(self, name: str, *, what: str, fallback: str):
        self.source_path, self.prefix = CSRC / f"{name}.cpp", f"capsnet_{name}"
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()
        self._tried = False
        self._absent = False  # the cache held no build when "auto" last looked (looked once per process)
        self._module: ModuleType | None = None
        self._error = ""

    def built(self) -> bool:
        """Whether capsnet's kernel cache holds a build of this kernel for this machine (either set of flags)."""
        source, key = extension_source(self.source_path), build_key()
        return any(is_built(extension_name(self.prefix, source, cpu, key)) for cpu in (_cpu_model(), None))

    def build(self, verbose: bool = False) -> ModuleType:
        """Compile the kernel now (or load the cached build), whatever CAPSNET_NO_EXT says; KernelBuildError (a
        RuntimeError) if it does not build. Once built, "auto" uses it here and in every later process."""
        with self._lock:
            if self._module is None:
                try:
                    self._module = build_extension(self.source_path, self.prefix, verbose, notice=self.what)
                except Exception as e:
                    self._error = f"{type(e).__name__}: {e}"
                    raise KernelBuildError(f"cannot build {self.what}: {self._error[:1000]}") from e
                finally:
                    self._tried = True
            self._absent = False
            return self._module

    def load(self, verbose: bool = False, *, raise_errors: bool = False) -> ModuleType | None:
        """The compiled extension, building it on the first call (thread-safe); None if disabled or unbuildable
        (one warning, or RuntimeError with `raise_errors`)."""
        if os.environ.get("CAPSNET_NO_EXT", "") not in ("", "0"):
            return None
        if not self._tried:
            with self._lock:
                if not self._tried:
                    try:
                        self._module = build_extension(self.source_path, self.prefix, verbose, notice=self.what)
                    except Exception as e:
                        self._error = f"{type(e).__name__}: {e}"
                        if not raise_errors:
                            warnings.warn(
                                f"capsnet: {self.what} could not be built; using {self.fallback} instead "
                                f"({str(e)[:300]})",
                                RuntimeWarning,
                                stacklevel=3,  # the caller of the kernel module's available() (or load())
                            )
                    self._tried = True
        if self._module is None and raise_errors:
            raise RuntimeError(f"capsnet: cannot build {self.what}: {self._error}")
        return self._module

    def load_if_built(self) -> ModuleType | None:
        """The extension if it is loaded or the cache holds a build (loaded without compiling); else None, after
        one log line per process saying how to build the kernels (`NOT_BUILT`). None under CAPSNET_NO_EXT."""
        if os.environ.get("CAPSNET_NO_EXT", "") not in ("", "0"):
            return None
        if self._tried:
            return self._module
        if self._absent:
            return None
        if not self.built():
            self._absent = True
            if not _NOTED["not built"]:
                _NOTED["not built"] = True
                log.warning(NOT_BUILT)
            return None
        return self.load()

    def kernel(self) -> ModuleType:
        """The loaded extension; a build failure raises (as `load(raise_errors=True)`)."""
        module = self.load(raise_errors=True)
        if module is None:  # CAPSNET_NO_EXT: callers check `available()` first, so this is a bug if it happens
            raise RuntimeError(f"capsnet: {self.what} is disabled (CAPSNET_NO_EXT)")
        return module

    def usable(self, backend: str | None = None) -> bool:
        """Whether a layer whose `backend` is `backend` (None: the global choice, `capsnet.routing.backend`) runs
        this kernel on CPU tensors: never under "torch"; under "auto" if it is already built (never compiled here);
        under "cpp" always (built on the first call), and a kernel that does not build raises."""
        choice = resolve_backend(backend)
        if choice == "torch":
            return False
        if choice == "cpp":
            self.kernel()
            return True
        return self.load_if_built() is not None

    def checks(
        self,
    ) -> tuple[Callable[[], bool], Callable[[torch.Tensor, torch.Tensor, str | None], bool]]:
        """The kernel module's `available()`, whether the kernel is used under the global backend choice (built
        only under "cpp"), and `applicable(u, weight, backend=None)`, whether it handles these inputs: CPU tensors,
        and a layer backend (None: the global one) under which the kernel is used."""
        # torch.compile takes each answer as a constant: the lock and the build stay untraced
        available = assume_constant_result(lambda: self.usable(None))
        per_layer = {name: assume_constant_result(partial(self.usable, name)) for name in BACKENDS}

        def applicable(u: torch.Tensor, weight: torch.Tensor, backend: str | None = None) -> bool:
            if u.device.type != "cpu" or weight.device.type != "cpu":
                return False
            return available() if backend is None else per_layer[backend]()

        return available, applicable
