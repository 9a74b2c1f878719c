"""Ad hoc (2026-12-06; from the repository root: `PYTHONPATH=. .venv/bin/python experiments/static_via_auto.py 4`, the batch size).
auto's path with tree2x2x1x1's nodes kept (the static subset of each offer) vs the static policy
itself vs auto: does the per-request path or the selection make the difference? (ad hoc)"""
import sys
from pathlib import Path
import torch
import native_engine.budget as budget
from native_engine.tree import subtree
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
batch = int(sys.argv[1])
WIDTHS = (2, 2, 1, 1)
def static_nodes(tree, widths):
    children, keep, frontier = tree.children(), set(), [-1]
    for w in widths:
        nxt = []
        for parent in frontier:
            for c in children[parent + 1][:w]:
                keep.add(c); nxt.append(c)
        frontier = nxt
    return sorted(keep)
_plan = budget.BudgetPlanner.plan
mode = {"static": False}
def plan(self, decode, offers, max_nodes, context_tokens):
    trees, p = _plan(self, decode, offers, max_nodes, context_tokens)
    if mode["static"]:
        trees = [subtree(t, static_nodes(t, WIDTHS)) for t in offers]
        p = budget.BudgetPlan(budget=sum(len(t) for t in trees), predicted=p.predicted)
    return trees, p
budget.BudgetPlanner.plan = plan
folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16, config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
eng = engine_for(base, "auto", batch); eng.calibrate_step_cost()
warm = run(base, "auto", request_set(REQUESTS[batch], 0, 96, folder, split="train"), batch, eng.budget)["planner"]
reqs = request_set(REQUESTS[batch], 0, 96, folder)
greedy_ids = [r["id"] for r in reqs if r["greedy"]]
for rnd in range(2):
    for name in ("auto", "static-via-auto", "tree2x2x1x1"):
        mode["static"] = name == "static-via-auto"
        r = run(base, "tree2x2x1x1" if name == "tree2x2x1x1" else "auto", reqs, batch, None if name == "tree2x2x1x1" else warm)
        print(f"b{batch} r{rnd} {name:16s} {r['decode_tokens_per_s']:6.1f} tok/s  nodes/seq {r['mean_nodes_per_seq']:.2f}  "
              f"acc len {r['mean_accepted_length']:.3f}  output tokens {r['output_tokens']}  greedy tokens "
              f"{sum(len(v) for v in r['greedy_outputs'].values())}", flush=True)
