"""Side by side (ad hoc, 2026-12-05): the panel weights gathered on 2 MB pages in the order a
forward streams them (`native_engine.cpu_linear.gather_panels`, native_engine/huge_pages.py) against the same
copies on ordinary 4 KB pages (each copied back out of the region). Two engines of SmolLM2-135M
in one process, eager, then both compiled (--compile), median decode step (30 steps, one prompt
repeated per row) at batch 1, 4 and 16 in interleaved rounds; greedy tokens compared; the
machine's AnonHugePages printed.

    PYTHONPATH=. .venv/bin/python experiments/ab_huge_pages.py [--compile] [rounds]
"""

import sys
from pathlib import Path

import torch

from bench.step_profile import MODEL, PROMPT, median_step_ms
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.cpu_linear import CpuLinear
from native_engine.requests import SamplingParams

torch.set_num_threads(2)
COMPILE = "--compile" in sys.argv
ROUNDS = int(next((a for a in sys.argv[1:] if a.isdigit()), 3))


def load():
    return NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=16, max_seq_len=1024))


def huge_kb() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("AnonHugePages"))
    return int(line.split()[1])


print(f"AnonHugePages before: {huge_kb()} kB", flush=True)
huge = load()
print(f"AnonHugePages with one engine: {huge_kb()} kB", flush=True)
small = load()
for m in small.model.modules():
    if isinstance(m, CpuLinear) and m.weight_panels is not None:
        m.weight_panels = m.weight_panels.clone()  # ordinary pages
print(f"AnonHugePages with both: {huge_kb()} kB", flush=True)
engines = {"4k": small, "2m": huge}
if COMPILE:
    for name, e in engines.items():
        print(f"{name} compiled in {e.compile_decode():.0f} s", flush=True)
    print(f"AnonHugePages compiled: {huge_kb()} kB", flush=True)
a = small.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
b = huge.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
print("same greedy tokens:", a == b, flush=True)
res = {}
for r in range(ROUNDS):
    for batch in (1, 4, 16):
        for name in (engines if r % 2 == 0 else reversed(list(engines))):
            res.setdefault((name, batch), []).append(median_step_ms(engines[name], 30, f"{name}{r}{batch}", batch))
    print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in res.items()), flush=True)
for batch in (1, 4, 16):
    print(f"batch {batch}: 4k / 2m step per round: " + " ".join(f"{x / y:.3f}" for x, y in zip(res[('4k', batch)], res[('2m', batch)])))
