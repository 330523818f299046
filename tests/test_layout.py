"""The package layout: which subpackage may import which, read from the source with ast (nothing is imported).

Layers, bottom up: the foundation modules (errors, fileio, config, fetch, _lazy, limits, plugins, results,
results_tables); configs (the model configs, torch-free: foundation only); nn; routing (nn); models (nn, routing);
data (foundation only); training (models, data, nn, routing); experiments, viz and lightning (training and below;
not each other); cli (anything). On top, the package's `__init__` (the public API) and `__main__`: nothing imports
them.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "capsnet"
FOUNDATION = {
    "errors",
    "fileio",
    "config",
    "_version",
    "fetch",
    "_lazy",
    "limits",
    "plugins",
    "results",
    "results_tables",
}

BELOW_TRAINING = {"foundation", "configs", "nn", "routing", "models", "data", "training"}
MAY_IMPORT: dict[str, set[str]] = {
    "foundation": {"foundation"},
    "configs": {"foundation", "configs"},
    "nn": {"foundation", "configs", "nn"},
    "routing": {"foundation", "configs", "nn", "routing"},
    "models": {"foundation", "configs", "nn", "routing", "models"},
    "data": {"foundation", "configs", "data"},
    "training": BELOW_TRAINING,
    "experiments": BELOW_TRAINING | {"experiments"},
    "viz": BELOW_TRAINING | {"viz"},
    "lightning": BELOW_TRAINING,
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


def module_cycle(modules: set[str]) -> list[str] | None:
    """An import cycle among `modules` (the import graph of their sources, lazy imports included), or None."""
    graph = {m: {t for t in imports_of(m) if t in modules} for m in modules}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path, node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_models_have_no_import_cycle_and_the_registry_is_the_floor():
    # the package's __init__ imports every model (that registers them); no module inside it imports the package
    models = {m for m in MODULES if m.startswith("capsnet.models.")}
    assert len(models) > 10
    cycle = module_cycle(models)
    assert cycle is None, f"import cycle in capsnet.models: {' -> '.join(cycle)}"
    floor = {"capsnet.models.registry", "capsnet.models.pretrained", "capsnet.models.hub", "capsnet.models.inputs"}
    model_modules = (
        {m for m in models if "capsnet.models.registry" in imports_of(m)} - floor - {"capsnet.models.factory"}
    )
    assert {"capsnet.models.capsnet", "capsnet.models.hvc_capsnet"} <= model_modules  # they register themselves
    for module in floor:
        assert not imports_of(module) & model_modules, f"{module} imports a model module"
    assert "capsnet.models" not in set().union(*(imports_of(m) for m in models))


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    for name, target in (("a", "b"), ("b", "a")):
        path = tmp_path / f"{name}.py"
        path.write_text(f"from . import {target}\n")
        monkeypatch.setitem(MODULES, f"capsnet.models.cyc_{name}", path)
    (tmp_path / "a.py").write_text("from .cyc_b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .cyc_a import y\n")
    assert module_cycle({"capsnet.models.cyc_a", "capsnet.models.cyc_b"}) is not None
    assert module_cycle({"capsnet.models.cyc_a"}) is None
