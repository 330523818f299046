"""Package attributes that import their module on first use (PEP 562), so that importing a package, or one
torch-free module inside it, does not import all of its modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose attribute NAME is `names[NAME]` (`module` or
    `module:attribute`, relative to the package) imported at its first read."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.partition(":")
        value = getattr(importlib.import_module(f"{package}.{module}"), attribute or name)
        namespace[name] = value  # the next read is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
