"""Ad hoc experiment (2026-12-06; run from the repository root:
`PYTHONPATH=. .venv/bin/python experiments/signal_check.py BATCHES`).

Does the target's own confidence where a sequence's offer starts (the top probability of the
distribution its last token, the bonus, was drawn from, at temperature 1) say more about which
offered nodes the output goes through than `auto`'s estimates already do? `auto` serves the
bench's requests (bench/native_budget.py: mixed, half sampled, real stopping, bf16) after its
warm-up; every offered node resolved in hindsight is logged with its estimate, depth, sampling
class and that confidence. Prints the share on the output's path per (estimate bin,
confidence bin)."""
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import native_engine.budget as budget
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
batches = [int(b) for b in sys.argv[1].split(",")]
CONF_EDGES = (0.3, 0.6, 0.9, 0.99)

captured = {}
conf_at: dict[int, dict[int, float]] = defaultdict(dict)  # id(req) -> output length -> confidence
rows: list[tuple] = []  # (phase, estimate, edge, depth, cls, conf, hit)
phase = ["warm"]

folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16,
                                    config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
model_logits = base.model.logits


def logits_hook(hidden):
    out = model_logits(hidden)
    captured["logits"] = out
    return out


base.model.logits = logits_hook
original_verify = NativeEngine._verify


def verify_hook(self, decode, trees):
    results, verified, padded = original_verify(self, decode, trees)
    if decode:
        logits = captured["logits"]
        offset = 0
        for req, tree, res in zip(decode, trees, results):
            row = offset + res.path[-1]
            offset += len(tree) + 1
            conf = float(torch.softmax(logits[row].detach().float(), -1).max())
            conf_at[id(req)][len(req.output) + len(res.tokens)] = conf
    return results, verified, padded


NativeEngine._verify = verify_hook
original_resolve = budget.BudgetPlanner.resolve_offers


def resolve_hook(self, req):
    for offer in req.offers:
        nodes = budget.hindsight(offer.tree, req.output[offer.start:], req.finished)
        if nodes is None:
            continue
        conf = conf_at[id(req)].get(offer.start)
        if conf is None:
            continue
        depths = offer.tree.depths()
        for i, hit in nodes:
            rows.append((phase[0], offer.probs[i], offer.edges[i], depths[i], offer.cells[i][0], conf, hit))
    original_resolve(self, req)


budget.BudgetPlanner.resolve_offers = resolve_hook

run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
for b in batches:
    rows.clear()
    reqs = request_set(REQUESTS[b], 0, 96, folder)
    train = request_set(REQUESTS[b], 0, 96, folder, split="train")
    eng = engine_for(base, "auto", b)
    eng.calibrate_step_cost()
    phase[0] = "warm"
    warm = run(base, "auto", train, b, eng.budget)["planner"]
    phase[0] = "test"
    r = run(base, "auto", reqs, b, warm)
    print(f"b{b}: auto decode {r['decode_tokens_per_s']:.1f} tok/s, {len(rows)} resolved nodes", flush=True)
    a = np.array([(p, e, d, c, f, h) for ph, p, e, d, c, f, h in rows if ph == "test"], dtype=float)
    np.save(f"/tmp/signal-b{b}.npy", np.array([(ph == "test", p, e, d, c, f, h) for ph, p, e, d, c, f, h in rows], dtype=float))
    p, depth, cls, conf, hit = a[:, 0], a[:, 2], a[:, 3], a[:, 4], a[:, 5]
    cb = np.searchsorted(CONF_EDGES, conf, side="right")
    pb = np.minimum((p * 5).astype(int), 4)
    print(f"b{b} confidence bins {CONF_EDGES}: nodes / share on path")
    for c in range(len(CONF_EDGES) + 1):
        m = cb == c
        print(f"  conf bin {c}: {m.sum():5d} nodes, on path {hit[m].mean() if m.any() else float('nan'):.3f}, "
              f"mean estimate {p[m].mean() if m.any() else float('nan'):.3f}")
    print(f"b{b} estimate bin (0.2 wide) x confidence bin: on path (nodes)")
    for e in range(5):
        cells = []
        for c in range(len(CONF_EDGES) + 1):
            m = (pb == e) & (cb == c)
            cells.append(f"{hit[m].mean():.2f} ({m.sum()})" if m.any() else "  -  ")
        print(f"  est {e * 0.2:.1f}-{e * 0.2 + 0.2:.1f}: " + " | ".join(cells))
    for k, name in ((0, "greedy"), (2, "hot")):
        for dname, dm in (("depth 1", depth == 1), ("depth 2+", depth > 1)):
            m0 = (cls == k) & dm
            parts = []
            for c in range(len(CONF_EDGES) + 1):
                m = m0 & (cb == c)
                parts.append(f"{hit[m].mean():.2f}/{p[m].mean():.2f} ({m.sum()})" if m.any() else "-")
            print(f"  {name} {dname}: on path/estimate per conf bin: " + " | ".join(parts))
    # How much a per-confidence-bin correction of the estimate would improve log loss (in-sample).
    eps = 1e-4
    pc = np.clip(p, eps, 1 - eps)
    ll = -(hit * np.log(pc) + (1 - hit) * np.log(1 - pc)).mean()
    adj = pc.copy()
    for c in range(len(CONF_EDGES) + 1):
        m = cb == c
        if m.any():
            adj[m] = np.clip(pc[m] * hit[m].sum() / max(pc[m].sum(), eps), eps, 1 - eps)
    ll2 = -(hit * np.log(adj) + (1 - hit) * np.log(1 - adj)).mean()
    print(f"b{b} log loss: estimates {ll:.4f}, scaled per confidence bin {ll2:.4f}", flush=True)
