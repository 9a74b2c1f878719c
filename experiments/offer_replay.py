"""Ad hoc diagnosis (2026-12-06; run from the repository root:
`PYTHONPATH=. .venv/bin/python experiments/offer_replay.py BATCH [ROUNDS]`).

`auto` serves the bench's requests (bench/native_budget.py: mixed, half sampled, real
stopping, bf16) at one batch size after the bench's calibration and warm-up; every step's
offers are kept with the nodes `auto` verified and, once the outputs resolve them, the nodes
the output went through (`hindsight`: for a node not verified, what verifying it would have
done, in distribution). Then, on the same steps and offers, other selections are scored
offline: a static tree's nodes (the same drafter ranks siblings alike, so tree2x2x1x1 is a
sub-shape of the offer), every node the output went through (the oracle), and `auto`'s own
selection with its estimates remapped. Each is priced by the engine's fitted step cost at the
end of the run (StepCost: sequences, tokens, padding to the longest row, context), and the
printout gives draft tokens accepted per sequence-step, nodes per sequence-step and predicted
tokens/s per selection. The trajectory is `auto`'s: a static policy's own run would offer at
other positions, so these are comparisons on equal offers, not a benchmark."""
import sys
from pathlib import Path

import numpy as np
import torch

import native_engine.budget as budget
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
# As run on 2026-12-06 (a variant where a calibrated engine never explores): every step's
# kept nodes are then best_selection's, which is what is captured below.
budget.EXPLORE_EVERY = 10**9
batch = int(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1

steps: list[dict] = []  # per auto step: n, context, [(offer or None)] per sequence
_plan, _best_selection, _score = budget.BudgetPlanner.plan, budget.best_selection, budget.BudgetPlanner._score
captured: dict = {}
recording = False


def best_selection(ranked, seqs, step_seconds, max_nodes=None):
    chosen = _best_selection(ranked, seqs, step_seconds, max_nodes)
    captured["chosen"] = chosen
    return chosen


def plan(self, decode, offers, max_nodes, context_tokens):
    before = [len(r.offers) for r in decode]
    out = _plan(self, decode, offers, max_nodes, context_tokens)
    if recording:
        row = []
        for s, (req, k) in enumerate(zip(decode, before)):
            offer = req.offers[-1] if len(req.offers) > k else None
            if offer is not None:
                offer.kept = {i for _, s2, i in captured["chosen"] if s2 == s}
                offer.sclass = budget.sampling_class(req.params)
            row.append(offer)
        steps.append({"n": len(decode), "context": context_tokens, "offers": row})
    return out


def score(self, offer, on_path, known, finished):
    offer.on_path, offer.known, offer.finished = set(on_path), known, finished
    return _score(self, offer, on_path, known, finished)


budget.best_selection, budget.BudgetPlanner.plan, budget.BudgetPlanner._score = best_selection, plan, score


def static_nodes(tree, widths) -> set[int]:
    """The nodes of `tree` a static tree of `widths` keeps: per parent its first widths[d] children."""
    children, keep, frontier = tree.children(), set(), [-1]
    for w in widths:
        nxt = []
        for parent in frontier:
            for c in children[parent + 1][:w]:
                keep.add(c)
                nxt.append(c)
        frontier = nxt
    return keep


def evaluate(name, select, cost) -> None:
    """select(offer) -> set of kept node ids (a rooted subtree)."""
    gained = seconds = nodes = seq_steps = 0.0
    for st in steps:
        n, kept_all, acc, longest = st["n"], 0, 0, 0
        for offer in st["offers"]:
            if offer is None or not hasattr(offer, "on_path"):
                continue
            kept = select(offer)
            kept_all += len(kept)
            longest = max(longest, len(kept))
            acc += len(kept & offer.on_path)
        gained += n + acc
        nodes += kept_all
        seq_steps += n
        seconds += float(cost.seconds(n, n + kept_all, n * (1 + longest), st["context"]))
    print(f"  {name:34s} accepted/seq-step {(gained - seq_steps) / seq_steps:.3f}  nodes/seq-step "
          f"{nodes / seq_steps:.3f}  predicted {gained / seconds:6.1f} tok/s", flush=True)


folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16,
                                    config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
eng = engine_for(base, "auto", batch)
eng.calibrate_step_cost()
warm = run(base, "auto", request_set(REQUESTS[batch], 0, 96, folder, split="train"), batch, eng.budget)["planner"]
recording = True
for _ in range(rounds):
    r = run(base, "auto", request_set(REQUESTS[batch], 0, 96, folder), batch, warm)
    print(f"b{batch} auto measured {r['decode_tokens_per_s']:.1f} tok/s, nodes/seq {r['mean_nodes_per_seq']:.2f}, "
          f"accepted length {r['mean_accepted_length']:.2f}", flush=True)
cost = r["planner"].cost
offers = [o for st in steps for o in st["offers"] if o is not None and hasattr(o, "on_path")]
print(f"b{batch}: {len(steps)} steps, {len(offers)} resolved offers")
evaluate("auto (as run)", lambda o: o.kept, cost)
for widths in ((1, 1), (1, 1, 1, 1), (2, 2, 1, 1), (4, 2, 2, 1)):
    evaluate(f"static {widths}", lambda o, w=widths: static_nodes(o.tree, w), cost)
evaluate("oracle (every node on the path)", lambda o: o.on_path, cost)
# Per sampling class and depth: offered nodes, kept, on path; p's mean.
for cls in range(budget.SAMPLING_CLASSES):
    rows = []
    for d in range(1, 9):
        off = kept = hit = khit = 0
        psum = 0.0
        for o in offers:
            if o.sclass != cls:
                continue
            depths = o.tree.depths()
            for i, dd in enumerate(depths):
                if dd != d or (o.finished and dd > o.known):
                    continue
                off += 1
                psum += o.probs[i]
                hit += i in o.on_path
                kept += i in o.kept
                khit += i in o.kept and i in o.on_path
        if off:
            rows.append(f"d{d}: offered {off} on-path {hit / off:.2f} mean p {psum / off:.2f} kept {kept} "
                        f"kept on-path {khit / max(kept, 1):.2f}")
    print(f" class {cls}: " + " | ".join(rows))
# Static (2,2,1,1) nodes auto did not keep, and auto's nodes outside it: how often on the path.
a_only = s_only = a_hit = s_hit = 0
for o in offers:
    s = static_nodes(o.tree, (2, 2, 1, 1))
    a_only += len(o.kept - s)
    a_hit += len((o.kept - s) & o.on_path)
    s_only += len(s - o.kept)
    s_hit += len((s - o.kept) & o.on_path)
print(f"auto's nodes outside tree2x2x1x1: {a_only}, on path {a_hit / max(a_only, 1):.2f}; "
      f"tree2x2x1x1's nodes auto left out: {s_only}, on path {s_hit / max(s_only, 1):.2f}")
np.save("/tmp/offer_replay_done.npy", np.zeros(1))
