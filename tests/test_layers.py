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
    ("adaspec",),                    # shared types: policy, telemetry, engine contract, models, datasets
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
