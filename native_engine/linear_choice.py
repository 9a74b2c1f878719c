"""Which matmul path a CPU model's linears take, per number of tokens in a pass: measured.

A `CpuLinear` (native_engine/cpu_linear.py) can run its weight four ways:
- "gemv": input-major [in, out], a plain `x @ W_t` (MKL's GEMV at one row);
- "linear": the usual [out, in] layout, `F.linear` (MKL's sgemm on a transposed operand, which
  at 2-3 rows streams each weight row once for all of them: chain1/chain2 verify passes);
- "packed": oneDNN's prepacked blocked layout (verify passes, batches, prefill);
- "panels": adaspec's own kernel (float32 or bfloat16) on the weight in panels of 16 output
  features (native_engine/cpu_kernels.py), where it builds: on 2 AMD EPYC (Zen 2) cores
  1.3-1.5x faster than oneDNN's packed matmul at 1-16 rows, 1.14-1.36x at 24-256 (float32).
Which is fastest depends on the CPU, its BLAS, the dtype, the model's shapes and the number
of rows: on this project's 2-core machine "gemv" and "packed" have each won at one token on
different days, and "linear" beat both by 15% at 2-3 rows in float32 and lost everywhere in
bfloat16 (docs/native-engine.md). So when a model is prepared for serving, whole forwards of
TOKEN_COUNTS tokens are timed on each path (interleaved), and a pass of r rows takes the path
that was fastest at the smallest timed count >= r; above the largest, the packed layout.

In bfloat16 every decode step and verify pass takes one path (`one_path`): the fastest summed
over the counts up to STEP_TOKENS (decode steps of up to 16 sequences, verify passes of a few);
prefills keep the path by token count. Each path sums a row's products in its own order, and
bfloat16 rounds every layer's output, so a token's logits from a decode step (one row) and
from a verify pass (several) differ in their last bits where the two take different paths;
bfloat16 logits tie often (35.75 against 35.75), and greedy output under speculation then left
`off`'s: at token 3 of a HumanEval prompt with the panel kernel at 1-4 rows and oneDNN's above
(2026-12-05, Intel Xeon with AMX). With one path, a token's sums are the same whatever pass
computes it (docs/native-engine.md). A prompt's tokens are only ever computed by prefills,
and the same prompts prefilled together take the same path. In float32 the paths differ by
about 1e-7 and greedy output agrees.

The answer is cached per machine (CPU model, cores, torch threads, torch version) and model
shape and dtype, in $ADASPEC_CACHE_DIR/linear-choice.json (native_engine/machine_cache.py), so a
restart does not measure again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from native_engine.attention import causal_mask
from native_engine.machine_cache import read_cached, write_cached

PATHS = ("gemv", "linear", "packed", "panels")
# Tokens per pass that are timed: a batch-1 decode, short verify passes, decode steps of up to
# 16 sequences, verify passes of 16 sequences' trees, short prompts (a prefill runs one prompt
# per pass). On 2 AMD EPYC (Zen 2) cores the panel kernel won every count up to 256, by 1.14x
# at 256 (docs/native-engine.md, "The panel matmul"); wider passes keep oneDNN's.
TOKEN_COUNTS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)
REPS = 3  # timed forwards per path and token count, after one warm-up each
STEP_TOKENS = 16  # bfloat16: the counts up to this one choose the path of decode steps and verify passes
CACHE = "linear-choice.json"  # in $ADASPEC_CACHE_DIR (native_engine/machine_cache.py)


@dataclass
class LinearChoice:
    """The fastest path at each timed token count; more rows than the largest take "packed".
    With `steps` (bfloat16), every pass but a prefill takes that one path instead."""

    path_by_tokens: dict[int, str]  # timed token count -> the path a pass of up to that many rows takes
    times_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # path -> tokens -> ms per forward
    cached: bool = False  # read from the cache file, not measured in this process
    steps: str | None = None  # bfloat16: the one path of every pass but a prefill's (`one_path`)

    def route(self) -> tuple[str, ...]:
        """The path of a pass of r rows at index r (index 0 unused); the last entry is the
        path of every wider pass. With `steps`, that path at every index."""
        if self.steps is not None:
            return (self.steps,) * (max(self.path_by_tokens) + 2)
        return self.prefill_route()

    def prefill_route(self) -> tuple[str, ...]:
        """`route` for a prefill's passes: the fastest path at the smallest timed count >= r,
        "packed" above the largest."""
        counts = sorted(self.path_by_tokens)
        by_rows = [self.path_by_tokens[min(c for c in counts if c >= r)] for r in range(1, counts[-1] + 1)]
        return (by_rows[0], *by_rows, "packed")

    def paths(self) -> str:
        """The paths a pass takes, by its rows; the same text whether measured or read from
        the cache (the step-cost cache keys on it: a replica that reads the choice another
        measured must find that one's calibration)."""
        route = self.prefill_route()
        runs: list[list] = []  # [first rows, last rows (None: and above), path]
        for rows, path in enumerate(route[1:], start=1):
            if runs and runs[-1][2] == path:
                runs[-1][1] = rows
            else:
                runs.append([rows, rows, path])
        runs[-1][1] = None
        ranges = ", ".join(f"{first}{'+' if last is None else '' if last == first else f'-{last}'}: {path}"
                           for first, last, path in runs)
        if self.steps is not None:
            return f"matmul path of decode steps and verify passes {self.steps}, of prefills by tokens {ranges}"
        return f"matmul path by tokens per pass {ranges}"

    def __str__(self) -> str:
        return f"{self.paths()} ({'cached' if self.cached else 'measured'})"


def paths_for(linears: list) -> tuple[str, ...]:
    """The paths every one of `linears` can take here: adaspec's "panels" kernel only where it
    builds and takes every weight (float32, out features a multiple of 16)."""
    return tuple(p for p in PATHS if p != "panels" or all(m.runs_panels() for m in linears))


def choose(model, linears: list, key: str) -> LinearChoice:
    """The cached choice for `key`, else one measured on `model` (and cached); in reduced
    precision (any dtype but float32), `one_path` of it."""
    paths = paths_for(linears)
    key = f"{key}|paths={','.join(paths)}|tokens={','.join(map(str, TOKEN_COUNTS))}"
    known = read_cached(CACHE, key)
    if known is not None:
        choice = LinearChoice({int(t): p for t, p in known["path_by_tokens"].items()},
                              {p: {int(t): ms for t, ms in v.items()} for p, v in known["times_ms"].items()},
                              cached=True)
    else:
        choice = measure(model, linears, paths=paths)
        write_cached(CACHE, key, {"path_by_tokens": choice.path_by_tokens, "times_ms": choice.times_ms})
    return choice if linears[0].weight_t.dtype == torch.float32 else one_path(choice)


def one_path(choice: LinearChoice) -> LinearChoice:
    """`choice` with every decode step and verify pass on the path of least time summed over
    the timed counts up to STEP_TOKENS (see the module docstring: what bfloat16 needs)."""
    def step_ms(path: str) -> float:
        return sum(ms for tokens, ms in choice.times_ms[path].items() if tokens <= STEP_TOKENS)

    return LinearChoice(choice.path_by_tokens, choice.times_ms, choice.cached, steps=min(choice.times_ms, key=step_ms))


@torch.no_grad()
def measure(model, linears: list, clock=time.perf_counter, paths: tuple[str, ...] | None = None) -> LinearChoice:
    """Time forwards of TOKEN_COUNTS tokens with every linear on each of `paths` (default:
    `paths_for(linears)`), interleaved (the order alternates between repetitions); `clock`
    gives seconds."""
    paths = paths or paths_for(linears)
    times: dict[str, dict[int, float]] = {path: {} for path in paths}
    for m in linears:
        m.use(paths)  # every path's layout exists while they are timed
    for tokens in TOKEN_COUNTS:
        ids = torch.zeros((1, tokens), dtype=torch.long)
        pos = torch.arange(tokens)[None]
        mask = causal_mask(torch.tensor([tokens]), tokens)
        best = dict.fromkeys(paths, float("inf"))
        for rep in range(REPS + 1):
            for path in paths if rep % 2 == 0 else paths[::-1]:
                for m in linears:
                    m.route = (path,) * (tokens + 1)  # this path at up to `tokens` rows
                start = clock()
                model.logits(model(ids, pos, mask)[:, -1])
                if rep > 0:  # the first of each is a warm-up
                    best[path] = min(best[path], clock() - start)
        for path in paths:
            times[path][tokens] = 1e3 * best[path]
    return LinearChoice({t: min(paths, key=lambda p: times[p][t]) for t in TOKEN_COUNTS}, times)
