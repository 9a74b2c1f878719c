"""Side by side (ad hoc, 2026-12-05): a prefill pass of 1, 4 and 16 HumanEval prompts (the
prompts of bench.native_engine) with the prompts one after another, attention prompt by prompt
with `is_causal` (`prompt_lengths`, what NativeEngine._prefill runs now) against the way it ran
before: the prompts right-padded to one length, the matmuls on the real tokens only (Packing)
and RoPE, cache writes and attention in the padded layout under a causal mask. One engine of
SmolLM2-135M (float32, 2 threads), the same cache rows, 5 interleaved rounds, median of 3
passes each; each prompt's last hidden state compared.

    PYTHONPATH=. .venv/bin/python experiments/ab_prefill.py
"""

import statistics
import time
from pathlib import Path

import torch

from bench.native_engine import engine_prompts
from bench.step_profile import MODEL
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.attention import Packing, causal_mask
from native_engine.tree import attention_mask

torch.set_num_threads(2)
engine = NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=16, max_seq_len=1024))
texts, source = engine_prompts(16, "humaneval", Path())
prompts = [engine.tokenizer.encode(t).ids for t in texts]
print(source, "; tokens:", [len(p) for p in prompts], flush=True)


def padded(batch: list[list[int]]) -> torch.Tensor:
    """Last hidden state per prompt [P, D], the pre-2026-12-05 prefill."""
    lengths = torch.tensor([len(p) for p in batch])
    T = int(lengths.max())
    tokens = torch.zeros((len(batch), T), dtype=torch.long)
    for b, p in enumerate(batch):
        tokens[b, :len(p)] = torch.tensor(p)
    pos = torch.arange(T)[None, :].expand(len(batch), T)
    mask = attention_mask(causal_mask(lengths, T)[:, 0], torch.zeros_like(lengths), T)
    real = torch.cat([b * T + torch.arange(n) for b, n in enumerate(lengths.tolist())])
    packed = Packing(real, len(batch), T) if len(real) <= 0.75 * len(batch) * T else None
    hidden = engine.model(tokens, pos, mask, engine.cache, 0, pos, T, packed)
    if packed is not None:
        return hidden[0, torch.cumsum(lengths, 0) - 1]
    return hidden[torch.arange(len(batch)), lengths - 1]


def one_after_another(batch: list[list[int]]) -> torch.Tensor:
    lengths = [len(p) for p in batch]
    tokens = torch.tensor([t for p in batch for t in p])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    hidden = engine.model(tokens, pos, None, engine.cache, 0, prompt_lengths=tuple(lengths))
    return hidden[0, torch.tensor(lengths).cumsum(0) - 1]


ways = {"padded": padded, "one_after_another": one_after_another}
res = {}
with torch.no_grad():
    for batch in (1, 4, 16):
        a, b = padded(prompts[:batch]), one_after_another(prompts[:batch])
        print(f"batch {batch}: last hidden states max |diff| {float((a - b).abs().max()):.2e}", flush=True)
    for r in range(5):
        for batch in (1, 4, 16):
            for name in (ways if r % 2 == 0 else reversed(list(ways))):
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    ways[name](prompts[:batch])
                    times.append(time.perf_counter() - t0)
                res.setdefault((name, batch), []).append(statistics.median(times))
        print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1] * 1000:.0f} ms" for (n, b), v in res.items()), flush=True)
for batch in (1, 4, 16):
    a, b = res[("padded", batch)], res[("one_after_another", batch)]
    ratios = sorted(x / y for x, y in zip(a, b))
    print(f"batch {batch} ({sum(len(p) for p in prompts[:batch])} tokens): padded / one after another per round "
          + " ".join(f"{x:.3f}" for x in ratios)
          + f"  (median: one after another {statistics.median(b) * 1000:.0f} ms, padded {statistics.median(a) * 1000:.0f} ms)")
