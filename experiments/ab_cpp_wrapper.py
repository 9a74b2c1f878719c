"""Side by side (ad hoc, 2026-12-05): the compiled decode pass run by inductor's Python wrapper
against its C++ wrapper (`cpp_wrapper`, now compile_decode's default). Two engines of SmolLM2-135M
compiled in one process, median decode step (30 steps, one prompt repeated per row) at batch 1, 4
and 16 in 3 interleaved rounds; greedy tokens compared. The committed log came from the same
script before `cpp_wrapper` became a parameter (the C++ engine compiled under
`torch._inductor.config.patch(cpp_wrapper=True)`, the other with the defaults of then).

The log beside it was written before the steps were timed by bench.step_profile.median_step_ms
(then: 4 warm-up steps, not 5, and requests of 40 tokens).

    PYTHONPATH=. .venv/bin/python experiments/ab_cpp_wrapper.py
"""

import torch

from bench.step_profile import MODEL, PROMPT, median_step_ms
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.requests import SamplingParams

torch.set_num_threads(2)


def load():
    return NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=16, max_seq_len=1024))


py = load(); print(f"python wrapper compiled in {py.compile_decode(cpp_wrapper=False):.0f} s", flush=True)
cpp = load(); print(f"C++ wrapper compiled in {cpp.compile_decode():.0f} s", flush=True)
a = py.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
b = cpp.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
print("same greedy tokens:", a == b, flush=True)
engines = {"python": py, "cpp": cpp}
res = {}
for r in range(3):
    for batch in (1, 4, 16):
        for name in (engines if r % 2 == 0 else reversed(list(engines))):
            res.setdefault((name, batch), []).append(median_step_ms(engines[name], 30, f"{name}{r}{batch}", batch))
    print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in res.items()), flush=True)
for batch in (1, 4, 16):
    print(f"batch {batch}: python / cpp step per round: " + " ".join(f"{x / y:.3f}" for x, y in zip(res[('python', batch)], res[('cpp', batch)])))
