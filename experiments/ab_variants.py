"""Ad hoc experiment (2026-12-06; run from the repository root:
`PYTHONPATH=. .venv/bin/python experiments/ab_variants.py ROUNDS BATCHES STATICS VARIANT...`,
e.g. `... 3 1,4,16 tree2x2x1x1,tree4x2x2x1 base NEAR_BEST=0.01`).

Side by side in one process: `auto` under planner variants (overrides of native_engine.budget's
module constants, NAME=VALUE joined by '+'; `base` = none) against static policies, the
bench's requests (bench/native_budget.py: mixed, half sampled, real stopping, bf16). Each
variant calibrates its step cost and serves the train-split warm-up under its own settings;
rounds interleave every cell in a rotated order. Prints decode tok/s per run and, per round,
each variant over the round's best static."""
import ast
import sys

import torch
from pathlib import Path

import native_engine.budget as budget
from prepare.models import resolve_model
from bench.native_budget import MAX_SEQ_LEN, MODEL, REQUESTS, engine_for, request_set, run
from native_engine.engine import EngineConfig, NativeEngine

torch.set_num_threads(2)
rounds, batches, statics = int(sys.argv[1]), [int(b) for b in sys.argv[2].split(",")], sys.argv[3].split(",")
variants = sys.argv[4:]
DEFAULTS = {name: getattr(budget, name) for v in variants if v != "base" for kv in v.split("+")
            for name in [kv.split("=")[0]]}


def apply(variant: str) -> None:
    for name, value in DEFAULTS.items():
        setattr(budget, name, value)
    if variant != "base":
        for kv in variant.split("+"):
            name, value = kv.split("=")
            setattr(budget, name, ast.literal_eval(value))  # numbers and tuples, e.g. DEPTH_EDGES=(2,4,8)


folder = Path(resolve_model(MODEL, prepare=False))
base = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16,
                                    config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
run(base, "off", request_set(1, 0, 96, folder)[:1], 1)
for b in batches:
    reqs = request_set(REQUESTS[b], 0, 96, folder)
    train = request_set(REQUESTS[b], 0, 96, folder, split="train")
    warm = {}
    for v in variants:
        apply(v)
        eng = engine_for(base, "auto", b)
        eng.calibrate_step_cost()
        warm[v] = run(base, "auto", train, b, eng.budget)["planner"]
    names = statics + variants
    res = {}
    for rnd in range(rounds):
        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
            if name in variants:
                apply(name)
                r = run(base, "auto", reqs, b, warm[name])
            else:
                r = run(base, name, reqs, b)
            res.setdefault(name, []).append(r["decode_tokens_per_s"])
            print(f"b{b} round {rnd} {name:28s} decode {r['decode_tokens_per_s']:6.1f} tok/s  "
                  f"nodes/seq {r['mean_nodes_per_seq']:.2f}  acc len {r['mean_accepted_length']:.2f}", flush=True)
    for rnd in range(rounds):
        best = max(res[s][rnd] for s in statics)
        print(f"== b{b} round {rnd}: " + "; ".join(f"{v} / best static {res[v][rnd] / best:.3f}" for v in variants),
              flush=True)
    apply("base")
