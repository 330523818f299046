"""The package layout: which subpackage may import which, read from the source with ast (nothing is imported).

Layers, bottom up: the foundation modules (errors, fileio, config, fetch, _lazy, pixels, limits, plugins, results,
results_tables); configs (the model configs, torch-free: foundation only); nn; routing (nn); models (nn, routing);
data (foundation only); training (models, data, nn, routing); inference (the front door: training and below);
experiments and viz (inference and below), lightning and tools (training and below; none of them each other); cli
(anything). On top, the package's `__init__` (the public API) and `__main__`: nothing
imports them. No import cycle anywhere, and no façade: every import names the module that defines the name.
"""

import ast
import functools
import re
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
    "logs",
    "pixels",
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
    "inference": BELOW_TRAINING | {"inference"},
    "lightning": BELOW_TRAINING,
    "tools": BELOW_TRAINING | {"tools"},
    "experiments": BELOW_TRAINING | {"inference", "experiments"},
    "viz": BELOW_TRAINING | {"inference", "viz"},
    "cli": BELOW_TRAINING | {"inference", "experiments", "viz", "tools", "cli"},
    "api": BELOW_TRAINING | {"inference", "experiments", "viz", "tools", "cli", "api"},
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


def test_no_import_cycle_anywhere_in_the_package():
    # lazy imports inside functions count: a cycle dodged by importing late is still a cycle
    cycle = module_cycle(set(MODULES))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The syntax tree of the file at `path`, parsed once (the facade check reads each module many times)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def top_level_names(module: str) -> set[str]:
    """The names `module` binds at its top level (functions, classes, assignments), imports excluded."""
    names: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                walk(node.body)
                walk(getattr(node, "orelse", []))
                walk(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    walk(handler.body)

    walk(parsed(MODULES[module]).body)
    return names


def sibling_imports(module: str) -> dict[str, str]:
    """{name: the module of the same package it was imported from} for `module`'s top-level `from . import` names."""
    package = module.rpartition(".")[0]
    found = {}
    for node in parsed(MODULES[module]).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            target = f"{package}.{node.module}"
            found.update({(a.asname or a.name): target for a in node.names if target in MODULES})
    return found


def facade_imports(sources: dict[str, Path]) -> list[str]:
    """Imports in `sources` ({module name or path: file}) that take from a capsnet module (not a package's
    `__init__`) a name it only imported from another module of its own package."""
    found = []
    for where, path in sources.items():
        package = where.rpartition(".")[0] if where in MODULES and path.name != "__init__.py" else where
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])]) if node.level else node.module or ""
            if target not in MODULES or MODULES[target].name == "__init__.py":
                continue
            borrowed = sibling_imports(target)
            for alias in node.names:
                if alias.name in borrowed and alias.name not in top_level_names(target):
                    found.append(f"{where}: `{alias.name}` from {target} (defined in {borrowed[alias.name]})")
    return found


def test_no_module_re_exports_a_name_of_its_own_package():
    # every import names the module that defines the thing; only a package's __init__ gathers names
    root = PACKAGE.parents[1]
    sources = dict(MODULES)
    for folder in ("tests", "benchmarks", "tools", "examples"):
        sources.update({str(p.relative_to(root)): p for p in sorted((root / folder).rglob("*.py"))})
    assert not facade_imports(sources)
    for module, path in MODULES.items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exported = [n for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]  # fmt: skip
        names = {e.value for node in exported for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
        foreign = sorted(names & set(sibling_imports(module)) - top_level_names(module))
        assert not foreign, f"{module}.__all__ lists {foreign}, defined in another module of its package"


def test_the_facade_check_finds_a_re_export(tmp_path, monkeypatch):
    for name, text in (("fa_defines", "X = 1\n"), ("fa_passes", "from .fa_defines import X\n")):
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.setitem(MODULES, f"capsnet.training.{name}", tmp_path / f"{name}.py")
    user = tmp_path / "user.py"
    user.write_text("from capsnet.training.fa_passes import X\nfrom capsnet.training.fa_defines import X\n")
    assert facade_imports({"user.py": user}) == ["user.py: `X` from capsnet.training.fa_passes (defined in "
                                                 "capsnet.training.fa_defines)"]  # fmt: skip


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("capsnet.training")))
def test_each_training_module_says_its_one_job_in_its_first_line(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text(encoding="utf-8")))
    assert doc, f"{module} has no docstring"
    first = doc.splitlines()[0]
    assert first.endswith((".", ":")) and len(first) <= 120, f"{module}: the first line should be one sentence: {first}"


def test_docstrings_have_no_sphinx_roles():
    # the docs site renders docstrings as Markdown (mkdocstrings): ":class:`X`" would print literally; write `X`
    role = re.compile(r":(class|func|mod|meth|data|attr|exc|obj):`")
    found = [f"{m}:{n}" for m, p in MODULES.items()
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if role.search(line)]  # fmt: skip
    assert not found, f"Sphinx roles in {found[:5]}"


LIBRARY = ("nn", "routing", "models", "data", "training", "configs", "foundation")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) in LIBRARY))
def test_library_modules_log_instead_of_printing(module):
    # the command line prints; the library logs to the "capsnet" logger (capsnet.logs), which a user can silence
    calls = [n.lineno for n in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8")))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]  # fmt: skip
    assert not calls, f"{module} prints (lines {calls}); log to capsnet.logs.LOGGER instead"
