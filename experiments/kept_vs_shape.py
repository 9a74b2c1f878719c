"""Ad hoc experiment (2026-12-06; run from the repository root:
`PYTHONPATH=. .venv/bin/python experiments/kept_vs_shape.py BATCHES`).

On `auto`'s own offers (the bench's requests after its warm-up, bf16), in hindsight: the draft
tokens the nodes it kept got accepted, against those the static tree2x2x1x1's nodes of the same
offer (the first two children at depths 1 and 2, the first at 3 and 4) would have got, per
sampling class and previous step. Same offers, so this compares the choices, not trajectories."""
import sys
from collections import defaultdict
from pathlib import Path

import torch

import native_engine.budget as budget
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
batches = [int(b) for b in sys.argv[1].split(",")]
WIDTHS = (2, 2, 1, 1)
kept_of: dict[int, list[int]] = {}
stats = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])  # offers, auto nodes, auto accepted, shape nodes, shape accepted
on = [False]

_subtree = budget.subtree


def subtree_hook(tree, keep):
    kept_of[id(tree)] = list(keep)
    return _subtree(tree, keep)


budget.subtree = subtree_hook


def shape_nodes(tree) -> set[int]:
    children = tree.children()
    out, frontier = set(), [-1]
    for w in WIDTHS:
        nxt = []
        for parent in frontier:
            for c in children[parent + 1][:w]:
                out.add(c)
                nxt.append(c)
        frontier = nxt
    return out


def accepted_within(nodes, keep: set[int]) -> int:
    """Draft tokens accepted had `keep` (a rooted subtree) been verified: the output's path
    through the offer while it stays in `keep`."""
    n = 0
    for i, hit in nodes:
        if hit:
            if i not in keep:
                return n
            n += 1
    return n


_resolve = budget.BudgetPlanner.resolve_offers


def resolve_hook(self, req):
    if on[0]:
        for offer in req.offers:
            nodes = budget.hindsight(offer.tree, req.output[offer.start:], req.finished)
            if nodes is None:
                continue
            kept = set(getattr(offer, "kept", []))
            shape = shape_nodes(offer.tree)
            cls, last = offer.cells[0][0], offer.cells[0][1]
            s = stats[(cls, last)]
            s[0] += 1
            s[1] += len(kept)
            s[2] += accepted_within(nodes, kept)
            s[3] += len(shape)
            s[4] += accepted_within(nodes, shape)
    _resolve(self, req)


budget.BudgetPlanner.resolve_offers = resolve_hook
_plan = budget.BudgetPlanner.plan


def plan_hook(self, decode, offers, max_nodes, context_tokens):
    trees, plan = _plan(self, decode, offers, max_nodes, context_tokens)
    for req, offer in zip(decode, offers):
        if len(offer) and req.offers and req.offers[-1].tree is offer:
            req.offers[-1].kept = kept_of.get(id(offer), [])
    kept_of.clear()
    return trees, plan


budget.BudgetPlanner.plan = plan_hook

folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16,
                                    config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
for b in batches:
    stats.clear()
    reqs = request_set(REQUESTS[b], 0, 96, folder)
    eng = engine_for(base, "auto", b)
    eng.calibrate_step_cost()
    on[0] = False
    warm = run(base, "auto", request_set(REQUESTS[b], 0, 96, folder, split="train"), b, eng.budget)["planner"]
    on[0] = True
    r = run(base, "auto", reqs, b, warm)
    print(f"b{b}: auto decode {r['decode_tokens_per_s']:.1f} tok/s; per offer (class, previous step): "
          "auto nodes / accepted | tree2x2x1x1 nodes / accepted", flush=True)
    tot = [0] * 5
    for (cls, last), s in sorted(stats.items()):
        tot = [a + b_ for a, b_ in zip(tot, s)]
        print(f"  class {cls} last {last}: {s[0]:5d} offers  auto {s[1] / s[0]:.2f} / {s[2] / s[0]:.2f}  "
              f"shape {s[3] / s[0]:.2f} / {s[4] / s[0]:.2f}", flush=True)
    print(f"  all: {tot[0]} offers  auto {tot[1] / tot[0]:.2f} / {tot[2] / tot[0]:.2f}  "
          f"shape {tot[3] / tot[0]:.2f} / {tot[4] / tot[0]:.2f}", flush=True)
