"""Which matmul path a CPU model's linears take, per number of tokens in a pass: measured.

A `CpuLinear` (native_engine/model.py) keeps two layouts of its weight: input-major for a
plain `x @ W_t` ("gemv"), and oneDNN's prepacked blocked layout ("packed"). Which is faster
depends on the CPU, its BLAS, the dtype, the model's shapes and the number of rows: on this
project's 2-core machine each has won at one token on different days. So when a model is
prepared for serving, whole forwards of 1, 2, 4 and 8 tokens are timed with each path
(interleaved), and the model uses gemv up to the largest token count where gemv won at
that count and every smaller one (`gemv_below`), packed above. The answer is cached per
machine (CPU model, cores, torch threads, torch version) and model shape and dtype, in
$ADASPEC_CACHE_DIR/linear-choice.json, so a restart does not measure again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaspec.models import cache_dir

TOKEN_COUNTS = (1, 2, 4, 8)  # tokens per pass that are timed (a batch-1 decode, short verify passes)
REPS = 3  # timed forwards per path and token count, after one warm-up each


@dataclass
class LinearChoice:
    """gemv for passes of at most `gemv_below` rows, packed above (0: packed always)."""

    gemv_below: int
    times_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # path -> tokens -> ms per forward
    cached: bool = False  # read from the cache file, not measured in this process

    def __str__(self) -> str:
        how = "cached" if self.cached else "measured"
        if self.gemv_below == 0:
            return f"oneDNN packed at every token count ({how})"
        return f"input-major gemv up to {self.gemv_below} token(s) per pass, oneDNN packed above ({how})"


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


def cache_file(name: str = "linear-choice.json") -> Path:
    """Where a measured choice is cached: $ADASPEC_CACHE_DIR/`name`."""
    return cache_dir() / name


def read_cached(name: str, key: str) -> dict | None:
    """The entry cached under `key` in cache file `name`, or None."""
    try:
        return json.loads(cache_file(name).read_text()).get(key)
    except (OSError, ValueError):
        return None


def write_cached(name: str, key: str, entry: dict) -> None:
    """Cache `entry` (JSON values) under `key` in cache file `name`, with the time it was measured."""
    path = cache_file(name)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[key] = {**entry, "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: measure again next time


def choose(model, linears: list, key: str) -> LinearChoice:
    """The cached choice for `key`, else one measured on `model` (and cached)."""
    known = read_cached("linear-choice.json", key)
    if known is not None:
        return LinearChoice(known["gemv_below"], {p: {int(t): ms for t, ms in v.items()}
                                                   for p, v in known["times_ms"].items()}, cached=True)
    choice = measure(model, linears)
    write_cached("linear-choice.json", key, {"gemv_below": choice.gemv_below, "times_ms": choice.times_ms})
    return choice


@torch.no_grad()
def measure(model, linears: list, clock=time.perf_counter) -> LinearChoice:
    """Time forwards of TOKEN_COUNTS tokens with every linear on each path, interleaved;
    `clock` gives seconds."""
    from native_engine.model import causal_mask

    times: dict[str, dict[int, float]] = {"gemv": {}, "packed": {}}
    for tokens in TOKEN_COUNTS:
        ids = torch.zeros((1, tokens), dtype=torch.long)
        pos = torch.arange(tokens)[None]
        mask = causal_mask(torch.tensor([tokens]), tokens)
        best = {"gemv": float("inf"), "packed": float("inf")}
        for rep in range(REPS + 1):
            for path in ("gemv", "packed") if rep % 2 == 0 else ("packed", "gemv"):
                for m in linears:
                    m.gemv_below = tokens if path == "gemv" else 0
                start = clock()
                model.logits(model(ids, pos, mask)[:, -1])
                if rep > 0:  # the first of each is a warm-up
                    best[path] = min(best[path], clock() - start)
        for path in best:
            times[path][tokens] = 1e3 * best[path]
    gemv_below = 0
    for tokens in TOKEN_COUNTS:
        if times["gemv"][tokens] >= times["packed"][tokens]:
            break
        gemv_below = tokens
    return LinearChoice(gemv_below, times)
