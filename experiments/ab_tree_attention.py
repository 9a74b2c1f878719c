"""Verify passes with the tree-attention kernel against torch's attention under the mask (the
path before it), side by side (ad hoc, 2026-12-05): one engine per path on bench.native_budget's
mixed requests (chat and code edits, half sampled), the longest `batch` of them at once, the
median of the full-batch decode steps; paths interleaved over rounds. The old path is the
current code with `decode_attention.tree_attention` replaced by torch's attention over every
key under the additive mask (what `cached_attention` ran before).

    PYTHONPATH=. .venv/bin/python experiments/ab_tree_attention.py [rounds]
"""

import statistics
import sys
from pathlib import Path

import torch

import native_engine.attention as M
from prepare.models import resolve_model
from adaspec.policy import SpecPolicy
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, request_set
from native_engine import decode_attention
from native_engine.drafters import NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
kernel = decode_attention.tree_attention


def torch_attention(q, keys, values, counts, allowed):
    B, T, H, Dh = q.shape
    return M.attend(q.transpose(1, 2), keys, values, M.in_progress.inputs.mask).transpose(1, 2).reshape(B, T, H * Dh)


base = NativeEngine.from_pretrained(MODEL, config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
folder = Path(resolve_model(MODEL, prepare=False))
for batch, policy in ((4, "chain4"), (16, "chain2")):
    reqs = request_set(REQUESTS[batch], 0, 96, folder)
    ratios, outputs = [], {}
    for rnd in range(ROUNDS):
        med = {}
        for path in (("kernel", "torch") if rnd % 2 == 0 else ("torch", "kernel")):
            decode_attention.tree_attention = kernel if path == "kernel" else torch_attention
            engine = NativeEngine(base.model, NgramDrafter(), EngineConfig(max_batch_size=batch, max_seq_len=MAX_SEQ_LEN),
                                  SpecPolicy.parse(policy), base.tokenizer, tuple(base.eos_ids))
            out = {r["id"]: [] for r in reqs}
            for r in reqs:
                engine.add_request(r["id"], r["ids"], r["params"])
            while engine.has_unfinished():
                for o in engine.step():
                    out[o.request_id] += o.new_token_ids
            full = [s for s in engine.drain().steps if s.num_decode_reqs == batch and not s.prefill_tokens]
            med[path] = statistics.median(s.duration_s for s in full)
            outputs.setdefault(path, out)
        ratios.append(med["torch"] / med["kernel"])
        print(f"batch {batch} {policy} round {rnd}: full-batch step torch {1e3 * med['torch']:.1f} ms, "
              f"kernel {1e3 * med['kernel']:.1f} ms, torch / kernel {ratios[-1]:.3f}", flush=True)
    greedy = [r["id"] for r in reqs if r["greedy"]]
    same = sum(outputs["kernel"][i] == outputs["torch"][i] for i in greedy)
    print(f"batch {batch} {policy}: torch / kernel per round {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"greedy outputs equal in {same}/{len(greedy)}", flush=True)
decode_attention.tree_attention = kernel
