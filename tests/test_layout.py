"""The package layout: which subpackage may import which, read from the source with ast (nothing is imported).

Layers, bottom up: the foundation modules (errors, fileio, config, fetch); nn; routing (nn); models (nn, routing); data
(foundation only); training (models, data, nn, routing); experiments and viz (training and below; not each
other); cli (anything). On top, the package's `__init__` (the public API) and `__main__`: nothing imports them.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "capsnet"
FOUNDATION = {"errors", "fileio", "config", "_version", "fetch", "limits"}

BELOW_TRAINING = {"foundation", "nn", "routing", "models", "data", "training"}
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "nn": {"foundation", "nn"},
    "routing": {"foundation", "nn", "routing"},
    "models": {"foundation", "nn", "routing", "models"},
    "data": {"foundation", "data"},
    "training": BELOW_TRAINING,
    "experiments": BELOW_TRAINING | {"experiments"},
    "viz": BELOW_TRAINING | {"viz"},
    "cli": BELOW_TRAINING | {"experiments", "viz", "cli"},
    "api": BELOW_TRAINING | {"experiments", "viz", "cli", "api"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    """`capsnet.routing.dynamic` -> routing; `capsnet.errors` -> foundation; `capsnet` itself -> api."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "api"
    if len(parts) == 2 and parts[1] in FOUNDATION:
        return "foundation"
    return parts[1]


def imports_of(module: str) -> set[str]:
    """The capsnet modules that `module` imports anywhere in its source (lazy imports in functions included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "capsnet"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "capsnet":
                continue
            for alias in node.names:  # `from . import distributed` imports the submodule itself
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
    return found


def subpackage_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        for target in imports_of(module):
            if layer(target) != layer(module):
                graph.setdefault(layer(module), set()).add(layer(target))
    return graph


def test_every_module_belongs_to_a_known_layer():
    unknown = {m for m in MODULES if layer(m) not in MAY_IMPORT}
    assert not unknown, f"modules outside the layer rules (add their subpackage to MAY_IMPORT): {sorted(unknown)}"
    assert len(MODULES) > 30 and {"nn", "routing", "models", "data", "training", "cli"} <= {layer(m) for m in MODULES}


def test_imports_resolve_to_real_modules():
    for module in MODULES:
        missing = {t for t in imports_of(module) if t not in MODULES}
        assert not missing, f"{module} imports {missing}, which are not modules of capsnet"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_imports(module):
    allowed = MAY_IMPORT[layer(module)]
    upward = sorted(t for t in imports_of(module) if layer(t) not in allowed)
    assert not upward, f"{module} ({layer(module)}) imports {upward}; {layer(module)} may import {sorted(allowed)}"


def test_the_subpackage_graph_has_no_cycles():
    graph = subpackage_graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert graph["models"] >= {"nn", "routing"}  # the graph is read, not empty


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("from ..training.loop import train\n\n\ndef f():\n    import capsnet.cli\n")
    monkeypatch.setitem(MODULES, "capsnet.nn.bad", bad)
    assert imports_of("capsnet.nn.bad") == {"capsnet.training.loop", "capsnet.cli"}
    with pytest.raises(AssertionError, match="may import"):
        test_no_upward_imports("capsnet.nn.bad")


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py" and "." in m))
def test_each_subpackage_says_what_lives_there_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text(encoding="utf-8")))
    assert doc, f"{package}/__init__.py has no docstring"
    assert "May import:" in doc, f"{package}/__init__.py: the docstring should say what it may import ('May import:')"
    assert len(doc.split("May import:")[0].strip()) > 20, f"{package}/__init__.py: say what lives there first"
