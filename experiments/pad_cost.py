"""Ad hoc (2026-12-06; from the repository root: `PYTHONPATH=. .venv/bin/python experiments/pad_cost.py [profile]`).
What padding costs a batch-16 verify pass (bf16, 2 threads, contexts of 500 tokens): the same
real tokens laid out evenly or as one long chain among rows without drafts; median of 9 passes
per layout, interleaved. With `profile`: torch's profiler table for the even and the one-chain
layout of 16 nodes."""
import statistics
import sys
import time

import torch

from native_engine.engine import EngineConfig, NativeEngine, _chain
from native_engine.requests import Request, SamplingParams

torch.set_num_threads(2)
eng = NativeEngine.from_pretrained("smollm2-135m-instruct", dtype=torch.bfloat16,
                                   config=EngineConfig(max_batch_size=16, max_seq_len=1024))
gen = torch.Generator().manual_seed(0)
vocab = eng.model.args.vocab_size
greedy = SamplingParams(max_tokens=1)
decode = [Request(f"r{i}", [0] * 500, greedy, 0.0, output=[0], row=i, cache_len=500) for i in range(16)]
LAYOUTS = {  # nodes per row
    "off (16 roots)": [0] * 16,
    "even 1 x 16": [1] * 16,
    "even 2 x 16": [2] * 16,
    "one chain of 16": [16] + [0] * 15,
    "two chains of 8": [8, 8] + [0] * 14,
    "4 rows of 4": [4] * 4 + [0] * 12,
    "chain 8 + 1 x 8": [8] + [1] * 8 + [0] * 7,
}
times = {k: [] for k in LAYOUTS}
for rep in range(10):
    for name, nodes in LAYOUTS.items():
        trees = [_chain(n, gen, vocab) for n in nodes]
        t0 = time.perf_counter()
        eng._verify(decode, trees)
        if rep:
            times[name].append(time.perf_counter() - t0)
for name, nodes in LAYOUTS.items():
    print(f"{name:18s} real {16 + sum(nodes):3d} padded {16 * (1 + max(nodes)):3d}: "
          f"{1000 * statistics.median(times[name]):6.1f} ms (min {1000 * min(times[name]):.1f})", flush=True)
if sys.argv[1:] == ["profile"]:
    from torch.profiler import profile
    for name in ("even 1 x 16", "one chain of 16"):
        trees = [_chain(n, gen, vocab) for n in LAYOUTS[name]]
        with profile() as prof:
            for _ in range(5):
                eng._verify(decode, trees)
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
