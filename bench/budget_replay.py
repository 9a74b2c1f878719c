"""Replay: speculation policies on their own trajectories, over fixed outputs, timed by a fitted clock.

Why: the budget benchmark (bench/native_budget.py) times every policy on this machine, where a
cell moves 10-15% between runs and a sampled request's output differs from policy to policy;
a change to `auto` worth a few percent drowns in that. Here every policy decodes the same
outputs and a step lasts what a fit of measured steps says, so a rule replayed twice gives
the same number, and two rules differ only by what they verify and what that costs.

Why the outputs can be fixed: every candidate prompt lookup offers is a point mass (a matched
token), and verification emits each token distributed exactly as the target's, whatever the
candidates (native_engine/verify.py). Accepting a candidate exactly when the target's own
sample at that place is its token is one coupling of that rule (it accepts x with probability
p(x), and on a rejection the token comes from the rest of p), so an output sampled once from
the target (an `off` run) is a valid outcome under every policy: a node is accepted when its
path spells the output. Greedy outputs are the same under every policy anyway.

What it does, per batch size:
1. measures (once; kept in --data and reused): the bench's requests (test split) and its
   `auto` warm-up set (train split) under `off` for their outputs, the engine's step-cost
   anchors (calibrate_step_cost), and --rounds runs of each policy on the test split,
   interleaved, timing every verify pass (the target's pass and the acceptance);
2. the clock (`fitted_clock`): the step-cost model (adaspec.step_cost) fitted to every measured
   verify pass (`auto`'s included: its uneven layouts are ones no static policy runs);
   printed per policy: its measured tok/s, and its passes' measured over clocked seconds;
3. replays each policy as the engine steps (admit, draft, plan, verify, commit, prefill),
   with the engine's own drafter and planner; a step lasts the clock's verify pass plus the
   drafting and planning as timed here. `auto` starts from the anchors, is warmed up on the
   train split's replay, and learns from these seconds. `oracle` verifies exactly the offered
   nodes on the output's path: a bound for any choice among `auto`'s offers.
   Decode tok/s as in the bench: tokens gained over seconds of the steps without a prompt,
   pooled over --realizations outputs (the sampled requests drawn with as many seeds).
   What a step does besides (committing, bookkeeping) is left out for every policy.
`--variant NAME=VALUE+...` replays `auto` with native_engine.budget's constants overridden
(several allowed), beside the code as it is.

    PYTHONPATH=. .venv/bin/python -m bench.budget_replay [--batches 1,4,16] [--variant MAX_EDGE=0.8]...
        [--data /tmp/adaspec-replay.pkl] [--rounds 2] [--realizations 3] [--offer 4,2,2,1] [--out DIR]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pickle
import sys
import time
from collections import deque
from pathlib import Path

if not __package__:  # run as a file: this script's folder would shadow the native_engine package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import native_engine.budget as budget  # noqa: E402
from adaspec.step_cost import StepCost  # noqa: E402
from prepare.models import resolve_model  # noqa: E402
from bench import machine  # noqa: E402
from bench.native_budget import (  # noqa: E402
    BUDGETED, MAX_SEQ_LEN, MODEL, POLICIES, REQUESTS, engine_for, redrawn, request_set, run,
)
from native_engine.budget import BudgetPlanner  # noqa: E402
from native_engine.engine import EngineConfig, NativeEngine  # noqa: E402
from native_engine.requests import Request  # noqa: E402
from native_engine.tree import DraftTree, subtree  # noqa: E402
from native_engine.verify import Acceptance  # noqa: E402

STATICS = tuple(p for p in POLICIES if p != BUDGETED)  # the benchmark's static policies
ORACLE = "oracle"


def accept_along(tree: DraftTree, future: list[int]) -> Acceptance:
    """The nodes of `tree` the output `future` (its tokens after the root) goes through, and
    the bonus token after them (none where the output ends at the last accepted node)."""
    out = Acceptance(path=[0])
    children = tree.children()
    row = 0
    while len(out.tokens) < len(future):
        want = future[len(out.tokens)]
        node = next((n for n in children[row] if tree.tokens[n] == want), None)
        if node is None:
            out.tokens.append(want)
            break
        row = out.accept(children[row].index(node), node, want)
    return out


def step_features(trees: list[DraftTree]) -> tuple[int, int]:
    """(tokens verified, tokens of the padded layout), as NativeEngine._verify counts them."""
    return sum(len(t) + 1 for t in trees), len(trees) * (1 + max((len(t) for t in trees), default=0))


def fitted_clock(passes: list[tuple[float, int, int, int, int]]) -> StepCost:
    """The step-cost model over measured verify passes (seconds, seqs, tokens, padded, context),
    each an anchor, nothing forgotten, the prior all but left out: it only has to reproduce
    the measured passes, as closely as their timing allows. Read with
    `seconds(..., verify_only=True)`."""
    clock = StepCost(forgetting=1.0, prior_precision=1e-3)
    for p in passes:
        clock.add_anchor(*p)
    return clock


def replay(engine: NativeEngine, requests: list[dict], outputs: dict[str, list[int]], clock: StepCost,
           oracle: bool = False) -> dict:
    """`requests` through `engine`'s policy, drafter and planner (engine.budget, changed in
    place) as NativeEngine.step runs them, each decoding sequence's tokens taken from
    `outputs`. A step lasts the clock's verify pass plus its drafting and planning, timed as
    they run here. No model runs."""
    eos = frozenset(engine.eos_ids)
    planner = engine.budget
    waiting = deque(Request(r["id"], r["ids"], r["params"], 0.0) for r in requests)
    running: list[Request] = []
    gained = steps = nodes = 0
    seconds = host = 0.0
    # Per step with decoding sequences, per sequence: nodes verified, draft tokens accepted, output tokens left.
    trace = []
    while waiting or running:
        new = []
        while waiting and len(running) < engine.config.max_batch_size:
            running.append(waiting.popleft())
            new.append(running[-1])
        decode = running[: len(running) - len(new)]
        if decode:
            config = engine.slot.config_for(len(running))
            shape = engine.shape_for(config)
            context = sum(r.cache_len for r in decode)
            start = time.perf_counter()
            drafting = oracle or not config.per_request or planner.should_draft(len(decode), context)
            draft_start = time.perf_counter()
            trees = engine._draft(decode, shape) if drafting else [DraftTree() for _ in decode]
            draft_s = time.perf_counter() - draft_start
            plan = None
            if oracle:
                trees = [subtree(t, sorted(n - 1 for n in accept_along(t, outputs[r.request_id][len(r.output):]).path[1:]))
                         for r, t in zip(decode, trees)]
            elif config.per_request:
                trees, plan = planner.plan(decode, trees, config.max_nodes, context)
            host_s = time.perf_counter() - start
            futures = [outputs[r.request_id][len(r.output):] for r in decode]
            results = [accept_along(t, future) for t, future in zip(trees, futures)]
            tokens, padded = step_features(trees)
            for req, result in zip(decode, results):
                req.cache_len += len(result.path)
                req.append(result.tokens, eos)
            start = time.perf_counter()
            if plan is not None:
                planner.observe(decode, trees, results, plan)
                if drafting:
                    planner.record_draft(len(decode), draft_s, plan)
                else:
                    planner.undrafted_steps += 1
            host_s += time.perf_counter() - start
            step_s = float(clock.seconds(len(decode), tokens, padded, context, verify_only=True)) + host_s
            trace.append(([len(t) for t in trees], [r.num_accepted for r in results], [len(f) for f in futures]))
            if not new:
                planner.record_step(step_s, len(decode), tokens, padded, context)
                gained += len(decode) + sum(r.num_accepted for r in results)
                seconds += step_s
                host += host_s
                steps += len(decode)
                nodes += tokens - len(decode)
        for req in new:
            req.cache_len = len(req.prompt)
            req.append(outputs[req.request_id][:1], eos)
        running = [r for r in running if not r.finished]
    return {"gained": gained, "seconds": seconds, "host_s": host, "sequence_steps": steps, "nodes": nodes,
            "steps": trace}


def summed(runs: list[dict]) -> dict:
    """Replays pooled (tokens over seconds of them all): decode tok/s, draft nodes per sequence
    and step, accepted length, and the drafting and planning's share of the time."""
    total = {k: sum(r[k] for r in runs) for k in ("gained", "seconds", "host_s", "sequence_steps", "nodes")}
    return {"decode_tokens_per_s": total["gained"] / total["seconds"],
            "nodes_per_seq": total["nodes"] / total["sequence_steps"],
            "accepted_length": total["gained"] / total["sequence_steps"],
            "host_share": total["host_s"] / total["seconds"]}


class VerifyTimer:
    """NativeEngine._verify timed while in use: (seconds, seqs, tokens, padded, context) per pass."""

    def __init__(self) -> None:
        self.passes: list[tuple[float, int, int, int, int]] = []
        self._verify = NativeEngine._verify

    def __enter__(self) -> VerifyTimer:
        timer, verify = self, self._verify

        def timed(engine, decode, trees):
            start = time.perf_counter()
            out = verify(engine, decode, trees)
            if decode:
                timer.passes.append((time.perf_counter() - start, len(decode), out[1], out[2],
                                     sum(r.cache_len for r in decode)))
            return out

        NativeEngine._verify = timed
        return self

    def __exit__(self, *exc) -> None:
        NativeEngine._verify = self._verify


def measure(base: NativeEngine, batch: int, seed: int, max_tokens: int, folder: Path, rounds: int) -> dict:
    """What the replay needs of one batch size, measured on the real engine (see the docstring):
    `rounds` runs of each policy, interleaved in a rotated order."""
    test = request_set(REQUESTS[batch], seed, max_tokens, folder)
    train = request_set(REQUESTS[batch], seed, max_tokens, folder, split="train")
    calibrated = engine_for(base, "auto", batch)
    calibrated.calibrate_step_cost()
    data = {"test": test, "train": train, "anchors": list(calibrated.budget.cost.anchor_passes),
            "train_outputs": run(base, "off", train, batch)["outputs"], "passes": {}, "measured": {}}
    warm = run(base, "auto", train, batch, calibrated.budget)["planner"]
    policies = STATICS + ("auto",)
    for rnd in range(rounds):
        for policy in policies[rnd % len(policies):] + policies[: rnd % len(policies)]:
            with VerifyTimer() as timer:
                r = run(base, policy, test, batch, warm if policy == "auto" else None)
            if policy == "off" and rnd == 0:
                data["outputs"] = [r["outputs"]]
            data["passes"].setdefault(policy, []).extend(timer.passes)
            data["measured"].setdefault(policy, []).append(r["decode_tokens_per_s"])
            print(f"[replay] batch {batch:2d} round {rnd} measured {policy:12s} {r['decode_tokens_per_s']:6.1f} tok/s",
                  flush=True)
    return data


def more_outputs(base: NativeEngine, data: dict, batch: int, realizations: int) -> None:
    """Outputs of the test split under `off` until there are `realizations` of them: the
    sampled requests drawn again with other seeds (greedy ones come out the same)."""
    while len(data["outputs"]) < realizations:
        k = len(data["outputs"])
        data["outputs"].append(run(base, "off", redrawn(data["test"], k), batch)["outputs"])
        print(f"[replay] batch {batch:2d} outputs {k + 1}/{realizations}", flush=True)


def apply_variant(variant: str, defaults: dict) -> None:
    """native_engine.budget's constants as `variant` sets them ("base": as they are)."""
    for name, value in defaults.items():
        setattr(budget, name, value)
    if variant != "base":
        for item in variant.split("+"):
            name, value = item.split("=", 1)
            setattr(budget, name, ast.literal_eval(value))


def offering(engine: NativeEngine, offer: tuple[int, ...] | None) -> NativeEngine:
    """`engine`, its sequences offering trees of these widths under per-request budgets
    (None: the drafter's own)."""
    engine.config = dataclasses.replace(engine.config, budget_offer=offer)
    return engine


def warmed_auto(base: NativeEngine, data: dict, batch: int, clock: StepCost, offer: tuple[int, ...] | None = None
                ) -> NativeEngine:
    """An `auto` engine (offering `offer`) whose planner holds the anchors and has replayed the
    train split."""
    engine = offering(engine_for(base, "auto", batch), offer)
    engine.budget = BudgetPlanner()
    for anchor in data["anchors"]:
        engine.budget.cost.add_anchor(*anchor)
    replay(engine, data["train"], data["train_outputs"], clock)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--data", default="/tmp/adaspec-replay.pkl",
                        help="measurements kept here and reused (delete it to measure again)")
    parser.add_argument("--rounds", type=int, default=2, help="measured runs of each policy")
    parser.add_argument("--realizations", type=int, default=3,
                        help="outputs replayed: the sampled requests' drawn with this many seeds")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offer", default=None,
                        help="widths of the candidate tree `auto` and `oracle` are offered, e.g. 8,4,4,2 "
                             "(default: the drafter's own)")
    parser.add_argument("--out", default=None, help="write replay.json and replay.png here")
    args = parser.parse_args()
    offer = tuple(int(w) for w in args.offer.split(",")) if args.offer else None
    torch.set_num_threads(2)
    batches = [int(b) for b in args.batches.split(",")]
    base = NativeEngine.from_pretrained(MODEL, dtype=getattr(torch, args.dtype),
                                        config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
    path = Path(args.data)
    store = pickle.loads(path.read_bytes()) if path.exists() else {}
    if any(b not in store or len(store[b]["outputs"]) < args.realizations for b in batches):
        folder = Path(resolve_model(MODEL, prepare=False))
        run(base, "off", request_set(1, args.seed, args.max_tokens, folder)[:1], 1)  # warm-up
        for b in batches:
            if b not in store:
                store[b] = measure(base, b, args.seed, args.max_tokens, folder, args.rounds)
            more_outputs(base, store[b], b, args.realizations)
            path.write_bytes(pickle.dumps(store))
    defaults = {item.split("=", 1)[0]: getattr(budget, item.split("=", 1)[0])
                for v in args.variant for item in v.split("+")}
    report = {"command": " ".join(sys.argv[1:]), "machine": machine.describe(), "batches": {}}
    for b in batches:
        data = store[b]
        clock = fitted_clock([p for passes in data["passes"].values() for p in passes])
        print(f"\nbatch {b}: policy | measured tok/s (runs) | measured / clocked verify seconds | replayed tok/s | "
              "nodes/seq | accepted length | drafting and planning, share of the replayed time")
        rates = {}
        for policy in STATICS + (ORACLE, "auto") + tuple(args.variant):
            apply_variant(policy if policy in args.variant else "base", defaults)
            if policy in STATICS:
                engine = engine_for(base, policy, b)
            elif policy == ORACLE:
                engine = offering(engine_for(base, "auto", b), offer)
            else:
                engine = warmed_auto(base, data, b, clock, offer)
            # Each realization of the outputs in turn, the planner learning on.
            r = summed([replay(engine, data["test"], outputs, clock, policy == ORACLE)
                        for outputs in data["outputs"][: args.realizations]])
            rates[policy] = r["decode_tokens_per_s"]
            passes = data["passes"].get(policy, [])
            fit = sum(p[0] for p in passes) / sum(clock.seconds(*p[1:], verify_only=True) for p in passes) if passes else float("nan")
            measured = ", ".join(f"{x:.1f}" for x in data["measured"].get(policy, [])) or "-"
            report["batches"].setdefault(b, {})[policy] = {
                **r, "measured_tokens_per_s": data["measured"].get(policy, []),
                "measured_over_clocked": fit if passes else None}
            print(f"{policy} | {measured} | {fit:.3f} | {r['decode_tokens_per_s']:.1f} | {r['nodes_per_seq']:.2f} | "
                  f"{r['accepted_length']:.2f} | {r['host_share']:.1%}", flush=True)
        apply_variant("base", defaults)
        best = max(STATICS, key=rates.get)
        for policy in ("auto",) + tuple(args.variant) + (ORACLE,):
            print(f"batch {b}: {policy} / {best} (the best static, replayed) = {rates[policy] / rates[best]:.3f}")
            report["batches"][b][policy]["over_best_static"] = rates[policy] / rates[best]
        report["batches"][b]["best_static"] = best
    if args.out:
        write_report(report, Path(args.out))


def write_report(report: dict, out: Path) -> None:
    """replay.json, and replay.png: replayed decode tok/s per policy, one panel per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(report, indent=2))
    batches = report["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
    for ax, (b, cells) in zip(axes[0], batches.items()):
        policies = [p for p in cells if p != "best_static"]
        colors = ["tab:blue" if p in STATICS else "tab:gray" if p == ORACLE else "tab:red" for p in policies]
        ax.bar(range(len(policies)), [cells[p]["decode_tokens_per_s"] for p in policies], color=colors)
        ax.set_xticks(range(len(policies)), policies, rotation=45, ha="right")
        ax.set_title(f"batch {b}: auto / {cells['best_static']} = {cells['auto']['over_best_static']:.3f}")
        ax.set_ylabel("decode tokens/s (replayed)")
    fig.suptitle("Replayed over fixed outputs: static policies, auto, and an oracle over auto's offers")
    fig.tight_layout()
    fig.savefig(out / "replay.png", dpi=120)
    print(f"[replay] wrote {out}/replay.json and replay.png", flush=True)


if __name__ == "__main__":
    main()
