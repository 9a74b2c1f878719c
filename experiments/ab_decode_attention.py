"""Side by side (ad hoc, 2026-12-05): decode steps attending with adaspec's decode-attention
kernel (native_engine/decode_attention.py) against torch's scaled_dot_product_attention. One
engine of SmolLM2-135M with its decode pass compiled (as bench.native_engine --compile-decode
runs it); `model.decode_kernel` switches the attention between rounds, outside the compiled
graph, so both sides run the same graph and weights. Median decode step (30 steps, one prompt
repeated per row) at batch 1, 4 and 16, for a short prompt (about 20 tokens) and a long one
(the short one 16 times, about 300), in 3 interleaved rounds; greedy tokens compared.

    PYTHONPATH=. .venv/bin/python experiments/ab_decode_attention.py
"""

import torch

from bench.step_profile import MODEL, PROMPT, median_step_ms
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.requests import SamplingParams

torch.set_num_threads(2)

engine = NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=16, max_seq_len=1024))
print(f"compiled in {engine.compile_decode():.0f} s; kernel available: {engine.model.uses_decode_kernel()}", flush=True)
prompts = {"short": PROMPT, "long": " ".join([PROMPT] * 16)}
tokens = {}
for side in ("torch", "kernel"):
    engine.model.decode_kernel = side == "kernel"
    tokens[side] = engine.generate([prompts["long"]], SamplingParams(max_tokens=60, ignore_eos=True))[0]
print("same greedy tokens:", tokens["torch"] == tokens["kernel"], flush=True)
res = {}
for r in range(3):
    for context, prompt in prompts.items():
        for batch in (1, 4, 16):
            for side in (("torch", "kernel") if r % 2 == 0 else ("kernel", "torch")):
                engine.model.decode_kernel = side == "kernel"
                res.setdefault((context, batch, side), []).append(
                    median_step_ms(engine, 30, f"{side}{r}{context}{batch}", batch, prompt))
            print(f"round {r + 1} {context} batch {batch}: torch {res[(context, batch, 'torch')][-1]:.1f} ms, "
                  f"kernel {res[(context, batch, 'kernel')][-1]:.1f} ms", flush=True)
for context in prompts:
    for batch in (1, 4, 16):
        a, b = res[(context, batch, "torch")], res[(context, batch, "kernel")]
        print(f"{context} prompt, batch {batch}: torch / kernel step per round: "
              + " ".join(f"{x / y:.3f}" for x, y in zip(a, b))
              + f"  (kernel {sorted(b)[1]:.1f} ms, torch {sorted(a)[1]:.1f} ms)")
