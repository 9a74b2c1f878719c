"""Side by side (ad hoc, 2026-12-05): a layer's attention as one kernel call that writes the
pass's keys and values to the cache and attends (`decode_attention.write_and_attend`, now the
engine's) against the Python path it replaced (KVCache.update's writes and views, then the
decode or tree kernel through its Python wrapper). One engine of SmolLM2-135M, the path
switched between measurements, median decode step (30 steps, one prompt repeated per row) at
batch 1, 4 and 16 in interleaved rounds, eager and then compiled (--compile); greedy tokens
compared. Also a chain4 verify step at batch 4 (prompt lookup), where verify passes take the
tree kernel.

    PYTHONPATH=. .venv/bin/python experiments/ab_write_and_attend.py [--compile] [rounds]
"""

import sys

import torch

from adaspec.policy import SpecPolicy
from bench.step_profile import MODEL, PROMPT, median_step_ms
from native_engine import decode_attention
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.requests import SamplingParams

torch.set_num_threads(2)
ROUNDS = int(next((a for a in sys.argv[1:] if a.isdigit()), 3))
fused = decode_attention.write_and_attend


def python_path(q, k, v, cache, layer, row_start, write_pos, counts, allowed=None):
    keys, values = cache.update(layer, row_start, write_pos, k, v, cache.max_len if allowed is None else allowed.shape[-1])
    if allowed is None:
        B, T, H, Dh = q.shape
        return decode_attention.decode_attention(q[:, 0], keys, values, counts).view(B, T, H * Dh)
    return decode_attention.tree_attention(q, keys, values, counts, allowed)


paths = {"python": python_path, "fused": fused}
engine = NativeEngine.from_pretrained(MODEL, config=EngineConfig(max_batch_size=16, max_seq_len=1024))
if "--compile" in sys.argv:
    print(f"compiled in {engine.compile_decode():.0f} s", flush=True)
outs = {}
for name, f in paths.items():
    decode_attention.write_and_attend = f
    outs[name] = engine.generate([PROMPT] * 2, SamplingParams(max_tokens=40, ignore_eos=True))
print("same greedy tokens:", outs["python"] == outs["fused"], flush=True)
res = {}
for r in range(ROUNDS):
    for policy, batches in (("off", (1, 4, 16)), ("chain4", (4,))):
        engine.apply_policy(SpecPolicy.parse(policy))
        for batch in batches:
            for name in (paths if r % 2 == 0 else reversed(list(paths))):
                decode_attention.write_and_attend = paths[name]
                res.setdefault((name, policy, batch), []).append(
                    median_step_ms(engine, 30, f"{name}{r}{policy}{batch}", batch))
    print(f"round {r + 1}: " + ", ".join(f"{n} {p} b{b} {v[-1]:.1f}" for (n, p, b), v in res.items()), flush=True)
decode_attention.write_and_attend = fused
for policy, batch in (("off", 1), ("off", 4), ("off", 16), ("chain4", 4)):
    print(f"{policy} batch {batch}: python / fused step per round: " + " ".join(
        f"{x / y:.3f}" for x, y in zip(res[("python", policy, batch)], res[("fused", policy, batch)])))
