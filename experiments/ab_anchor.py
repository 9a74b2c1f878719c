"""Ad hoc experiment (2026-12-06; run from the repository root:
`PYTHONPATH=. .venv/bin/python experiments/ab_anchor.py ROUNDS 4,16`).

A/B in one process: auto with the default StepCost (RLS, forgetting 0.99) vs auto whose cost
fit is weighted least squares over the recent steps plus anchor rows measured before serving
(synthetic verify passes of several tree layouts at this batch size)."""
import sys, random, time, collections

import numpy as np, torch
from pathlib import Path
from prepare.models import resolve_model
from adaspec.policy import SpecPolicy
from bench.native_budget import request_set, run, MODEL, MAX_SEQ_LEN, REQUESTS
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.budget import BudgetPlanner, StepCost
from native_engine.requests import SamplingParams
from native_engine.tree import DraftTree
from native_engine.drafters import NgramDrafter
torch.set_num_threads(2)

class AnchoredCost(StepCost):
    def __init__(self, anchors, anchor_weight=1.0, window=300, forgetting=0.99):
        super().__init__()
        self.X0 = np.array([a[0] for a in anchors]); self.y0 = np.array([a[1] for a in anchors])
        self.w0 = anchor_weight; self.recent = collections.deque(maxlen=window); self.f = forgetting
        self._fit()
    def _fit(self):
        X = [self.X0]; y = [self.y0]; w = [np.full(len(self.y0), self.w0)]
        if self.recent:
            Xr = np.array([r[0] for r in self.recent]); yr = np.array([r[1] for r in self.recent])
            X.append(Xr); y.append(yr); w.append(self.f ** np.arange(len(yr))[::-1])
        X = np.vstack(X); y = np.concatenate(y); sw = np.sqrt(np.concatenate(w))[:, None]
        A = (X * sw).T @ (X * sw) + 1e-6 * np.eye(X.shape[1]); b = (X * sw).T @ (y * sw[:, 0])
        self.theta = np.linalg.solve(A, b)
    def add(self, duration_s, seqs, tokens, padded_tokens, context_tokens):
        self.recent.append((self.features(seqs, tokens, padded_tokens, context_tokens), duration_s))
        self.samples += 1
        self._fit()

def chain(k): return DraftTree(tokens=[5] * k, parents=list(range(-1, k - 1)), scores=[0.5] * k)

def measure_anchors(base, B):
    rows = []
    rng = random.Random(0)
    for ctx in (150, 500):
        eng = NativeEngine(base.model, NgramDrafter(), EngineConfig(max_batch_size=B, max_seq_len=MAX_SEQ_LEN),
                           SpecPolicy.parse("off"), base.tokenizer, tuple(base.eos_ids))
        for i in range(B):
            eng.add_request(str(i), [rng.randrange(1000, 20000) for _ in range(ctx)], SamplingParams(max_tokens=200, temperature=0))
        for _ in range(2):
            eng.step()
        decode = list(eng.running)
        layouts = [[0] * B, [1] * B, [2] * B, [4] * B, ([1, 0] * B)[:B], ([4, 0, 0, 0] * B)[:B], ([8, 0, 0, 0] * B)[:B],
                   ([0, 1, 2, 4] * B)[:B], ([2, 0] * B)[:B]]
        for rep in range(3):
            for ks in layouts:
                trees = [chain(k) for k in ks]
                t = time.perf_counter(); _, verified, padded = eng._verify(decode, trees); d = time.perf_counter() - t
                if rep:
                    context = sum(r.cache_len for r in decode)
                    rows.append((StepCost.features(B, verified, padded, context), d))
    return rows

rounds = int(sys.argv[1]); batches = [int(b) for b in sys.argv[2].split(",")]
folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16, config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
for b in batches:
    reqs = request_set(REQUESTS[b], 0, 96, folder)
    train = request_set(REQUESTS[b], 0, 96, folder, split="train")
    t0 = time.perf_counter(); anchors = measure_anchors(base, b)
    print(f"b{b}: {len(anchors)} anchor rows in {time.perf_counter() - t0:.1f} s", flush=True)
    anchored = BudgetPlanner(); anchored.cost = AnchoredCost(anchors)
    warm = {"auto": run(base, "auto", train, b, BudgetPlanner())["planner"],
            "auto-anchor": run(base, "auto", train, b, anchored)["planner"]}
    c = warm["auto-anchor"].cost; d = warm["auto"].cost
    for per_row in (1, 4):
        longest = np.array([0.0] + [per_row] * 64)
        for name, cc in (("rls", d), ("anchored", c)):
            secs = cc.step_seconds(b, b * 400, longest)
            print(f"  {name:8s} longest {per_row}: B=0 {1e3*secs[0]:.1f} ms, B={b} {1e3*secs[b]:.1f}, B={4*b} {1e3*secs[4*b]:.1f}", flush=True)
    names = ["off", "chain1", "chain2", "chain4", "auto", "auto-anchor"]
    res = {}
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            r = run(base, "auto" if name.startswith("auto") else name, reqs, b, warm.get(name))
            res.setdefault(name, []).append(r["decode_tokens_per_s"])
            share0 = r["steps_by_nodes"]["0"][0] / max(1, sum(v[0] for v in r["steps_by_nodes"].values()))
            print(f"b{b} round {rnd} {name:11s} decode {r['decode_tokens_per_s']:6.1f} tok/s  nodes/seq {r['mean_nodes_per_seq']:.2f}  acc len {r['mean_accepted_length']:.2f}  steps w/o node {share0:.2f}", flush=True)
    for rnd in range(rounds):
        best = max(res[n][rnd] for n in ("off", "chain1", "chain2", "chain4"))
        print(f"== b{b} round {rnd}: anchor / auto {res['auto-anchor'][rnd]/res['auto'][rnd]:.3f}; anchor / best static {res['auto-anchor'][rnd]/best:.3f}; auto / best static {res['auto'][rnd]/best:.3f}", flush=True)
