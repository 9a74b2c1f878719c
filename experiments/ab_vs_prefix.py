"""Ad hoc A/B (run from the repository root: PYTHONPATH=. .venv/bin/python experiments/ab_vs_prefix.py; 2026-12-05 00:25-00:39 UTC, its output in ab_vs_prefix.log): auto as landed (per-sequence caps) vs the previous planner (plain prefix only:
PER_SEQUENCE_CAPS emptied), interleaved with chain4 and chain2."""
import os, statistics
import torch
from pathlib import Path
from bench import native_budget as nb
from native_engine import budget as bm
from native_engine.engine import EngineConfig, NativeEngine
from prepare.models import resolve_model

class PrefixPlanner(bm.BudgetPlanner):
    def plan(self, *args, **kwargs):
        saved, bm.PER_SEQUENCE_CAPS = bm.PER_SEQUENCE_CAPS, ()
        try:
            return super().plan(*args, **kwargs)
        finally:
            bm.PER_SEQUENCE_CAPS = saved

torch.set_num_threads(2)
batches = (4, 16)
rounds = int(os.environ.get("ROUNDS", "3"))
folder = Path(resolve_model(nb.MODEL, prepare=False))
base = NativeEngine.from_pretrained(nb.MODEL, config=EngineConfig(max_batch_size=1, max_seq_len=nb.MAX_SEQ_LEN))
sets = {b: nb.request_set(nb.REQUESTS[b], 0, 96, folder) for b in batches}
nb.run(base, "off", sets[4][:1], 1)
warm = {}
for b in batches:
    train = nb.request_set(nb.REQUESTS[b], 0, 96, folder, split="train")
    w = nb.run(base, "auto", train, b)
    w2 = nb.run(base, "auto", train, b, PrefixPlanner())
    warm[b] = {"auto": w["planner"], "prefix": w2["planner"]}
    print(f"warm {b}: auto {w['decode_tokens_per_s']:.1f} / prefix {w2['decode_tokens_per_s']:.1f}", flush=True)
policies = ["chain4", "chain2", "auto", "prefix"]
res = {}
for rnd in range(rounds):
    for b in batches:
        order = policies[rnd % 4:] + policies[:rnd % 4]
        for p in order:
            r = nb.run(base, "auto" if p == "prefix" else p, sets[b], b, warm[b].get(p))
            res.setdefault((b, p), []).append(r["decode_tokens_per_s"])
            zero = next((x["step_share"] for x in nb.step_profile([r]) if x["nodes_per_seq"] == "0"), 0.0)
            print(f"round {rnd} batch {b:2d} {p:7s} decode {r['decode_tokens_per_s']:6.1f} tok/s  TPOT {1e3*(r['mean_tpot_s'] or 0):6.1f} ms "
                  f"nodes/seq {r['mean_nodes_per_seq']:.2f} acc len {r['mean_accepted_length']:.2f} undrafted steps {zero:.0%}", flush=True)
for b in batches:
    for p in ("auto", "prefix"):
        for s in ("chain4", "chain2"):
            ratios = [x / y for x, y in zip(res[(b, p)], res[(b, s)])]
            print(f"batch {b}: {p}/{s} per round: " + " ".join(f"{x:.3f}" for x in ratios) + f"  mean {statistics.fmean(ratios):.3f}")
    print(f"batch {b}: auto (caps) / prefix per round: " + " ".join(f"{x/y:.3f}" for x, y in zip(res[(b,'auto')], res[(b,'prefix')])))
