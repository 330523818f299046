"""The package version and the oldest torch it runs on, in a foundation module so that any layer can read them
without importing the public API. `capsnet/__init__` imports this module first, so an older torch stops
`import capsnet` here, with one line, before any module that needs a newer one is imported."""

from __future__ import annotations

import sys

__version__ = "0.1.0"

# torch.library.custom_op, its register_fake and torch.cuda.is_bf16_supported(including_emulation=...) are 2.4's.
TORCH_MIN = (2, 4)


def check_torch(version: str | None = None) -> None:
    """ImportError (one line, naming the version needed) when `version` (default: the installed torch's: that of
    the torch already imported, else its package metadata, so that torch itself is not imported) is older than
    TORCH_MIN."""
    if version is None and "torch" in sys.modules:
        version = str(sys.modules["torch"].__version__)
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:  # no torch distribution: its import fails, with its own message
            return
    release = version.split("+")[0].split(".")
    try:
        found = tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in release[:2])
    except ValueError:  # pragma: no cover - every torch version starts with its numbers
        return
    if found < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        raise ImportError(f"capsnet needs torch >= {need}, found torch {version}; pip install 'torch>={need}'")


check_torch()
