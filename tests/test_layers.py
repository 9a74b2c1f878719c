"""The package order (docs/architecture.md): each package imports only packages of lower layers.

Every `import` and `from ... import` in every module counts, the ones inside functions too:
a lazy import still ties the two packages together, and a cycle hidden that way is what
this check exists to catch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Bottom to top. A package may import packages of lower layers only (not its own layer's).
LAYERS: list[tuple[str, ...]] = [
    ("adaspec",),                    # shared types: policy, telemetry, engine contract, model and dataset names
    ("prepare",),                    # models and datasets onto this machine: pip, conversion, caches, dataset files
    ("native_engine", "controller"),  # the native engine; the controller's math and actor
    ("serve_app",),                  # the Ray Serve application and its engine adapters
    ("distill",),                    # draft-model distillation
    ("testkit",),                    # what the real-stack tests and the benchmark harness share
    ("bench",),                      # benchmarks
    ("cli",),                        # the `adaspec` command
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def imported_packages(path: Path) -> set[str]:
    """Top-level names this module imports (absolute imports only; relative ones stay inside)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported project package -> modules (paths) that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for pkg in LAYER_OF:
        edges: dict[str, list[str]] = {}
        for path in sorted((REPO / pkg).rglob("*.py")):
            for name in imported_packages(path) & LAYER_OF.keys() - {pkg}:
                edges.setdefault(name, []).append(str(path.relative_to(REPO)))
        graph[pkg] = edges
    return graph


def test_every_package_is_in_a_layer():
    found = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert found == set(LAYER_OF), f"packages not in LAYERS: {found - set(LAYER_OF)}; gone: {set(LAYER_OF) - found}"


@pytest.mark.parametrize("pkg", list(LAYER_OF))
def test_package_imports_only_lower_layers(pkg):
    upward = {name: modules for name, modules in package_imports()[pkg].items() if LAYER_OF[name] >= LAYER_OF[pkg]}
    assert not upward, "\n".join(f"{pkg} (layer {LAYER_OF[pkg]}) imports {name} (layer {LAYER_OF[name]}) in "
                                 f"{', '.join(modules)}" for name, modules in upward.items())


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_packages():
    graph = {pkg: set(edges) for pkg, edges in package_imports().items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a hidden lazy import from a lower package would show here."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_lazy_imports_count(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from bench.datasets import x\n    import serve_app.replica\n")
    assert imported_packages(module) == {"os", "bench", "serve_app"}


# ----------------------------------------------------------------------------------- modules
def project_modules(root: Path = REPO, packages=None) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` (default: every package in LAYER_OF)."""
    modules: dict[str, Path] = {}
    for pkg in LAYER_OF if packages is None else packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports(root: Path = REPO, packages=None) -> dict[str, set[str]]:
    """module -> the project modules it imports, the lazy imports inside functions included.

    `from pkg import mod` imports the module pkg.mod where that is one, else a name of pkg
    (pkg's __init__); a relative import is resolved against the importing module's package.
    A package's __init__ that runs first on `import pkg.mod` does not count: only the module named."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                bases = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for dotted in bases:  # the longest prefix that is a project module (`import a.b.c`)
                parts = dotted.split(".")
                found = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)
                if found is not None:
                    targets.add(found)
        graph[name] = targets - {name}
    return graph


def test_no_import_cycle_between_modules():
    """No module imports itself back round a chain of project modules, inside one package or
    across several: such a cycle works only as long as the import order and lazy imports allow
    it (native_engine.model <-> linear_choice, bench.phase <-> sweep were the last ones)."""
    cycle = find_cycle(module_imports())
    assert cycle is None, f"import cycle between modules: {' -> '.join(cycle)}"


def test_module_cycles_are_found(tmp_path):
    """The module graph sees a cycle through a lazy relative import and `from pkg import mod`."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("import os\n\ndef f():\n    from .a import g\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\nfrom pkg import VERSION\n")
    graph = module_imports(tmp_path, ["pkg"])
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a", "pkg"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (tmp_path / "pkg" / "b.py").write_text("import os\n")
    assert find_cycle(module_imports(tmp_path, ["pkg"])) is None
