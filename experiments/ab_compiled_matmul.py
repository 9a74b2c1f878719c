"""Side by side (ad hoc, 2026-12-05): the compiled decode pass with the matmul inductor picks itself
(MKL's packed sgemm in the batch-1 graph, float32) against the path the measured route chose
(`native_engine.cpu_linear.compiled_matmul_path`: oneDNN's prepacked matmul where one-token passes
were measured fastest there; only the graph of fixed rows changes, at batch 4 and 16 both run
inductor's own oneDNN graph, a check on the noise). Two engines of SmolLM2-135M compiled in one process, median decode
step (30 steps, one prompt repeated per row) at batch 1, 4 and 16 in 3 interleaved rounds.

The log beside it was written before the steps were timed by bench.step_profile.median_step_ms
(then: 4 warm-up steps, not 5, and requests of 40 tokens).

    PYTHONPATH=. .venv/bin/python experiments/ab_compiled_matmul.py
"""
import statistics

import torch

from bench.step_profile import MODEL, median_step_ms
from native_engine import cpu_linear as native_model
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)


def load() -> NativeEngine:
    return NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=16, max_seq_len=1024))






chosen = load()
print("route:", chosen.model.linear_choice, "| graph path:",
      {m.graph_path for m in chosen.model.modules() if isinstance(m, native_model.CpuLinear)} or "-", flush=True)
print(f"measured route compiled in {chosen.compile_decode():.0f} s", flush=True)
print("graph path:", {m.graph_path for m in chosen.model.modules() if isinstance(m, native_model.CpuLinear)}, flush=True)
own = native_model.compiled_matmul_path
native_model.compiled_matmul_path = lambda linear, autotune: "inductor"
inductor = load()
print(f"inductor's own compiled in {inductor.compile_decode():.0f} s", flush=True)
native_model.compiled_matmul_path = own
engines = {"inductor": inductor, "route": chosen}
res: dict[tuple[str, int], list[float]] = {}
for r in range(3):
    for batch in (1, 4, 16):
        for name in (engines if r % 2 == 0 else reversed(list(engines))):
            res.setdefault((name, batch), []).append(median_step_ms(engines[name], 30, f"{name}{r}{batch}", batch))
    print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f} ms" for (n, b), v in res.items()), flush=True)
for batch in (1, 4, 16):
    ratios = [a / b for a, b in zip(res[("inductor", batch)], res[("route", batch)])]
    print(f"batch {batch}: inductor's / route's step per round: " + " ".join(f"{x:.3f}" for x in ratios)
          + f"  (route {statistics.median(res[('route', batch)]):.1f} ms, inductor {statistics.median(res[('inductor', batch)]):.1f} ms)")
