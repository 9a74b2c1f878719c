"""adaspec reaches into `ray.llm._internal` from one adapter module, for the pinned Ray only."""

from __future__ import annotations

import ast
import re

import ray

from testkit.serve_process import REPO

ADAPTER = REPO / "serve_app" / "ray_llm.py"
# The project's packages, as tests/test_layers.py finds them.
PACKAGES = sorted({p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"})


def _pinned_minor() -> str:
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(r'"ray\[serve\]==(\d+\.\d+)\.\*"', text)
    assert m, "pyproject.toml must pin ray[serve]==MAJOR.MINOR.*"
    return m.group(1)


def test_installed_ray_is_the_pinned_minor():
    from serve_app.ray_llm import PINNED_RAY_MINOR

    assert PINNED_RAY_MINOR == _pinned_minor(), "serve_app/ray_llm.py and pyproject.toml name different Rays"
    installed = ".".join(ray.__version__.split(".")[:2])
    assert installed == PINNED_RAY_MINOR, (
        f"Ray {ray.__version__} is installed, but serve_app/ray_llm.py's ray.llm._internal imports were checked "
        f"against Ray {PINNED_RAY_MINOR}.x: install ray[serve]=={PINNED_RAY_MINOR}.* (scripts/install.sh does), "
        f"or re-check every import in serve_app/ray_llm.py and move the pin")


def test_internal_ray_llm_is_imported_by_the_adapter_only():
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path == ADAPTER:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                              if n.startswith("ray.llm._internal")]
    assert not offenders, "import ray.llm._internal through serve_app/ray_llm.py:\n" + "\n".join(offenders)


def test_every_internal_import_says_why():
    """Each `from ray.llm._internal...` in the adapter sits under a comment giving the reason."""
    lines = ADAPTER.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("from ray.llm._internal"):
            assert lines[i - 1].startswith("#"), f"serve_app/ray_llm.py:{i + 1}: no reason above {line!r}"
