"""Side by side (ad hoc, 2026-12-05): decode steps with the passes the measured route gives
adaspec's panel matmul kernel (`panels`, native_engine/cpu_kernels.py) against the same route
with oneDNN's prepacked matmul (`packed`) in their place. Two engines of SmolLM2-135M in one
process, their decode passes compiled (the graphs call the route's matmul), median decode
step (30 steps, one prompt repeated per row) at batch 1, 4 and 16 in 3 interleaved rounds;
greedy tokens compared.

    PYTHONPATH=. .venv/bin/python experiments/ab_panels.py
"""

import torch

from bench.step_profile import MODEL, PROMPT, median_step_ms
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.cpu_linear import CpuLinear
from native_engine.requests import SamplingParams

torch.set_num_threads(2)


def load(replace_panels: bool) -> NativeEngine:
    engine = NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=16, max_seq_len=1024))
    if replace_panels:
        for m in engine.model.modules():
            if isinstance(m, CpuLinear):
                m.use(tuple("packed" if p == "panels" else p for p in m.route))
    return engine


kernel = load(False)
print("measured route:", kernel.model.linear_choice, flush=True)
print("times (ms per forward):", {p: {t: round(v, 1) for t, v in tt.items()} for p, tt in kernel.model.linear_choice.times_ms.items()}, flush=True)
onednn = load(True)
engines = {"packed": onednn, "panels": kernel}
for name, e in engines.items():
    print(f"{name}: compiled in {e.compile_decode():.0f} s", flush=True)
a = onednn.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
b = kernel.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
print("same greedy tokens:", a == b, flush=True)
res = {}
for r in range(3):
    for batch in (1, 4, 16):
        for name in (engines if r % 2 == 0 else reversed(list(engines))):
            res.setdefault((name, batch), []).append(median_step_ms(engines[name], 30, f"{name}{r}{batch}", batch))
    print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in res.items()), flush=True)
for batch in (1, 4, 16):
    a, b = res[("packed", batch)], res[("panels", batch)]
    print(f"batch {batch}: packed / panels step per round: " + " ".join(f"{x / y:.3f}" for x, y in zip(a, b))
          + f"  (panels {sorted(b)[1]:.1f} ms, packed {sorted(a)[1]:.1f} ms)")
