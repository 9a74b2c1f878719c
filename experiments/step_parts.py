"""Ad hoc (2026-12-06; from the repository root: `PYTHONPATH=. .venv/bin/python experiments/step_parts.py 4`, the batch size).
Where a step's time goes, auto vs tree2x2x1x1 at one batch size (bench requests, bf16)."""
import sys, time, functools
from pathlib import Path
import torch
import native_engine.engine as E
import native_engine.budget as budget
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
batch = int(sys.argv[1])
acc = {}
def timed(cls, name, label):
    f = getattr(cls, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] = acc.get(label, 0.0) + time.perf_counter() - t; return r
    setattr(cls, name, w)
for name in ("_draft", "_verify", "_commit", "step"):
    timed(E.NativeEngine, name, name)
timed(budget.BudgetPlanner, "plan", "plan")
timed(budget.BudgetPlanner, "observe", "observe")
timed(budget.BudgetPlanner, "record_step", "record_step")
folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16, config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
eng = engine_for(base, "auto", batch); eng.calibrate_step_cost()
warm = run(base, "auto", request_set(REQUESTS[batch], 0, 96, folder, split="train"), batch, eng.budget)["planner"]
reqs = request_set(REQUESTS[batch], 0, 96, folder)
for rnd in range(2):
    for pol in ("auto", "tree2x2x1x1"):
        acc.clear()
        r = run(base, pol, reqs, batch, warm if pol == "auto" else None)

        print(f"b{batch} r{rnd} {pol:12s} {r['decode_tokens_per_s']:6.1f} tok/s  " + "  ".join(f"{k} {v:.2f}s" for k, v in acc.items()), flush=True)
