"""Builds capsnet's C++ CPU routing kernels on request: `build_kernels` (``capsnet build-kernels``).

Until then the routing layers run their PyTorch paths on CPUs; once built (kept in capsnet's kernel cache,
`capsnet.routing.extension.extensions_root`), every process loads them under the "auto" backend without
compiling. docs/benchmarks.md ("No surprise build") says why the build is a step of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from . import dynamic_cpu, inverted_attention_cpu


@dataclass(frozen=True)
class BuiltKernel:
    """One kernel after `build_kernels`: what it is, its compiled file, whether this call compiled it (False:
    found in the cache) and the seconds the call took."""

    what: str
    path: Path
    compiled: bool
    seconds: float


KERNELS = (dynamic_cpu.EXTENSION, inverted_attention_cpu.EXTENSION)


def build_kernels(*, verbose: bool = False) -> list[BuiltKernel]:
    """Compile every C++ CPU routing kernel that the cache does not hold yet (one notice line on stderr per
    compilation) and load them in this process. Raises KernelBuildError naming the kernel that does not build."""
    built = []
    for extension in KERNELS:
        compiled = not extension.built()
        start = time.perf_counter()
        loaded = extension.build(verbose)
        path = Path(loaded.__file__ or extension.source_path)
        built.append(BuiltKernel(extension.what, path, compiled, time.perf_counter() - start))
    return built
