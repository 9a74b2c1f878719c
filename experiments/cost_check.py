"""Ad hoc (2026-12-06; from the repository root: `PYTHONPATH=. .venv/bin/python experiments/cost_check.py 4`, the batch size).
Does the step-cost fit price static policies' steps right? (ad hoc)"""
import sys
from pathlib import Path
import numpy as np, torch
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
batch = int(sys.argv[1])
folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16, config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
eng = engine_for(base, "auto", batch); eng.calibrate_step_cost()
warm = run(base, "auto", request_set(REQUESTS[batch], 0, 96, folder, split="train"), batch, eng.budget)["planner"]
reqs = request_set(REQUESTS[batch], 0, 96, folder)
captured = {}

orig_drain = NativeEngine.drain
def drain(self):
    rep = orig_drain(self); captured["steps"] = rep.steps; captured["cost"] = self.budget.cost; return rep
NativeEngine.drain = drain
for rnd in range(2):
    for pol in ("auto", "tree2x2x1x1", "chain2", "off"):
        r = run(base, pol, reqs, batch, warm if pol == "auto" else None)
        if pol == "auto":
            cost = captured["cost"]
        steps = [s for s in captured["steps"] if s.num_decode_reqs and not s.prefill_tokens]
        act = np.array([s.duration_s for s in steps])
        pred = np.array([float(cost.seconds(s.num_decode_reqs, s.num_decode_reqs + sum(s.nodes_per_seq),
                          s.num_decode_reqs * (1 + max(s.nodes_per_seq)), s.context_tokens)) for s in steps])
        nodes = np.array([sum(s.nodes_per_seq) / s.num_decode_reqs for s in steps])
        gained = sum(s.num_decode_reqs + sum(s.accepted_per_seq) for s in steps)
        print(f"b{batch} r{rnd} {pol:12s} {r['decode_tokens_per_s']:6.1f} tok/s  steps {len(steps)}  seq-steps "
              f"{sum(s.num_decode_reqs for s in steps)}  tokens {gained}  mean step {1e3*act.mean():.1f} ms  predicted "
              f"{1e3*pred.mean():.1f} ms  (actual/pred {act.sum()/pred.sum():.3f})  nodes/seq {nodes.mean():.2f}  "
              f"mean batch {np.mean([s.num_decode_reqs for s in steps]):.2f}", flush=True)
