"""What this machine measured, kept so a restart does not measure again.

Measurements that depend on the machine (the matmul paths, native_engine/linear_choice.py;
the dtype of `dtype: auto`, native_engine/dtype_choice.py; the engine's step cost,
`NativeEngine.load_or_calibrate_step_cost`) are cached in JSON files in $ADASPEC_CACHE_DIR,
one per kind, each entry under a key of the machine (`machine_key`: CPU model, cores, torch
threads, torch version), the model's shape and dtype (`model_key`) and whatever else the
measurement depends on. Delete a file to measure again.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from pathlib import Path

import torch

from prepare.models import cache_dir


def machine_key() -> str:
    """The machine as far as matmul speed goes: CPU model, usable cores, torch threads, torch."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}|cores={len(os.sched_getaffinity(0))}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def model_key(args, dtype: torch.dtype) -> str:
    return (f"dim={args.dim},layers={args.n_layers},heads={args.n_heads}/{args.n_kv_heads},"
            f"ffn={args.intermediate_size},vocab={args.vocab_size},{dtype}")


def cache_file(name: str) -> Path:
    """Where measurements are cached in file `name`: $ADASPEC_CACHE_DIR/`name`."""
    return cache_dir() / name


def read_cached(name: str, key: str) -> dict | None:
    """The entry cached under `key` in cache file `name`, or None."""
    try:
        return json.loads(cache_file(name).read_text()).get(key)
    except (OSError, ValueError):
        return None


def write_cached(name: str, key: str, entry: dict) -> None:
    """Cache `entry` (JSON values) under `key` in cache file `name`, with the time it was measured.

    Replicas starting together each add their entry under a lock on `name`.lock: read, add and
    replace as one step, so none is lost. Without it two replicas whose keys differed (their
    matmul routes, measured under each other's load) each wrote the file as they had read it,
    and the later one dropped the other's entry: a replacement of the first then timed its
    step cost again (tests/test_cluster.py caught it)."""
    path = cache_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError):
                entries = {}
            entries[key] = {**entry, "measured_at": time.time()}
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1))
            tmp.replace(path)
    except OSError:
        pass  # a read-only cache: measure again next time

