"""Per-request speculation budgets against the best per-batch-size policy, on mixed traffic.

The native engine (SmolLM2-135M-Instruct, float32, prompt lookup or with --draft-model a
draft model) serves the same requests
under `auto` (per-request budgets, native_engine/budget.py) and under each static policy
(`off`, chains, trees), at batch sizes 1, 4 and 16:
- requests: held-out ShareGPT chat turns and HumanEval code edits, alternating
  (`--dataset mixed`, prepare/datasets.py), chat-templated as served; half greedy, half at
  T=0.7 top_p 0.9 (bench/client.realistic_mix), each seeded (the seeds moved each round, so
  the sampled outputs are drawn afresh), stopping at EOS or at its dataset reply length (at
  most --max-tokens);
- each run queues `requests[batch]` requests into an engine of `batch` rows (continuous
  batching refills finished rows), so the batch stays near `batch` until the tail;
- rounds: every (batch, policy) cell once per round, policies in a rotated order, so drift
  of the machine spreads over all of them;
- `auto` learns (its acceptance calibration and step-cost fit, native_engine/budget.py), and
  a serving replica has learned before most requests arrive: so before the rounds, `auto`
  calibrates its step cost as a replica does at start (NativeEngine.calibrate_step_cost) and
  serves a warm-up set of the same size from the train split (no prompt in common), and
  every measured `auto` run starts from a copy of that state. Static policies learn nothing.

Measured per run: decode tokens/s (tokens gained by decoding sequences / seconds of the
steps without a prompt in them: prefill costs every policy alike and is left out), e2e
tokens/s (all output tokens / wall time), and each request's TPOT (seconds per output token
after its first). The best per-batch policy is chosen on the first half of the rounds by
decode tokens/s and scored on the others (held out: the best of several noisy cells favours
itself). Ratios: auto / best in decode tokens/s (per scoring round), and best / auto mean
TPOT with a 95% two-stage bootstrap interval (bench/compare.py). A step profile of `auto`
and the best static policy says where the time goes: the decode steps grouped by draft nodes
per sequence, each group's share of the steps and of the time, and its tokens/s.

Goal (issue 16): auto >= 1.2x the best per-batch policy's tokens/s at batch 4 and 16 at equal
or better TPOT, and never below it at batch 1.

    .venv/bin/python -m bench.native_budget [--rounds 4] [--batches 1,4,16] [--max-tokens 96] [--dtype bfloat16]
        [--policies off,chain2,chain4,tree2x2x1x1,tree4x2x2x1,auto] [--draft-model NAME] [--out bench/results/budget-cpu]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: this script's folder would shadow the native_engine package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from prepare.datasets import load_prompts  # noqa: E402
from prepare.models import resolve_model  # noqa: E402
from adaspec.policy import SpecPolicy  # noqa: E402
from bench import machine  # noqa: E402
from bench.client import realistic_mix  # noqa: E402
from bench.compare import bootstrap_ratio, mean  # noqa: E402
from bench.harness import reply_token_caps  # noqa: E402
from bench.verdicts import split_rounds  # noqa: E402
from distill.teacher import load_tokenizer  # noqa: E402
from native_engine.budget import BudgetPlanner  # noqa: E402
from native_engine.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from native_engine.engine import EngineConfig, NativeEngine  # noqa: E402
from native_engine.model import Transformer, load_model  # noqa: E402
from native_engine.requests import SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
BATCHES = (1, 4, 16)
REQUESTS = {1: 6, 4: 12, 16: 32}  # requests per run: enough to keep the batch full for most of it
POLICIES = ("off", "chain2", "chain4", "tree2x2x1x1", "tree4x2x2x1", "auto")
BUDGETED = "auto"
GOAL = {1: 1.0, 4: 1.2, 16: 1.2}
MAX_PROMPT_CHARS = 2500  # code edits carry a whole function; longer prompts are skipped
MAX_SEQ_LEN = 1024  # cache positions per row: the longest prompt + output + a tree
# Buckets of a step's draft nodes per decoding sequence (upper bounds, inclusive), for the
# step profile: where a policy spends its time, and what each kind of step yields.
NODE_BUCKETS = ((0.0, "0"), (1.0, "<=1"), (2.0, "1-2"), (4.0, "2-4"), (float("inf"), ">4"))


def request_set(n: int, seed: int, max_tokens: int, folder: Path, split: str = "test") -> list[dict]:
    """n mixed requests as the engine takes them: token ids, sampling, and max_tokens."""
    prompts = load_prompts("mixed", n, seed, split=split, max_prompt_chars=MAX_PROMPT_CHARS)
    tokenizer = load_tokenizer(folder)
    caps = reply_token_caps(prompts, MODEL, max_tokens)
    out = []
    for i, (p, cap, sampling) in enumerate(zip(prompts, caps, realistic_mix(n, seed))):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append({"id": p.id, "dataset": p.dataset, "ids": list(ids), "greedy": sampling.temperature == 0,
                    "params": SamplingParams(max_tokens=cap, temperature=sampling.temperature, top_p=sampling.top_p,
                                             seed=seed * 1000 + i)})
    return out


def redrawn(requests: list[dict], k: int) -> list[dict]:
    """`requests` with their sampling seeds moved by k (k = 0: as they are): the sampled
    requests draw another output, the greedy ones give the same."""
    return [{**r, "params": dataclasses.replace(r["params"], seed=r["params"].seed + 7919 * k)} for r in requests]


def steps_by_nodes(steps: list) -> dict[str, list[float]]:
    """Decode steps (StepRecords without prefill) grouped by draft nodes per decoding sequence
    (NODE_BUCKETS): label -> [steps, seconds, tokens gained]."""
    out = {label: [0, 0.0, 0] for _, label in NODE_BUCKETS}
    for s in steps:
        per_seq = sum(s.nodes_per_seq) / s.num_decode_reqs
        label = next(label for top, label in NODE_BUCKETS if per_seq <= top)
        cell = out[label]
        cell[0] += 1
        cell[1] += s.duration_s
        cell[2] += s.num_decode_reqs + sum(s.accepted_per_seq)
    return out


def step_profile(runs: list[dict]) -> list[dict]:
    """steps_by_nodes summed over runs: per bucket its share of the steps and of the decode
    time, and its tokens/s."""
    total_steps = sum(c[0] for r in runs for c in r["steps_by_nodes"].values())
    total_s = sum(c[1] for r in runs for c in r["steps_by_nodes"].values())
    rows = []
    for _, label in NODE_BUCKETS:
        steps, seconds, gained = (sum(r["steps_by_nodes"][label][k] for r in runs) for k in range(3))
        if steps:
            rows.append({"nodes_per_seq": label, "step_share": steps / total_steps, "time_share": seconds / total_s,
                         "tokens_per_s": gained / seconds, "ms_per_step": 1e3 * seconds / steps})
    return rows


def engine_for(base: NativeEngine, policy: str, batch: int, draft: Transformer | None = None) -> NativeEngine:
    """A fresh engine of `batch` rows over `base`'s weights; prompt lookup drafts, or `draft`
    (a draft model's weights) where given."""
    drafter = DraftModelDrafter(draft, batch, MAX_SEQ_LEN) if draft is not None else NgramDrafter()
    return NativeEngine(base.model, drafter, EngineConfig(max_batch_size=batch, max_seq_len=MAX_SEQ_LEN),
                        SpecPolicy.parse(policy), base.tokenizer, tuple(base.eos_ids))


def run(base: NativeEngine, policy: str, requests: list[dict], batch: int, planner: BudgetPlanner | None = None,
        draft: Transformer | None = None) -> dict:
    """Every request queued at once into a fresh engine of `batch` rows, until all finish;
    `planner`: the per-request budget state to start from (a copy is used); `draft`: as in
    `engine_for`."""
    engine = engine_for(base, policy, batch, draft)
    if planner is not None:
        engine.budget = copy.deepcopy(planner)
        engine.budget.reliability[:] = 0.0  # this run's nodes only
        engine.budget.offered_accepted = 0
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    outputs: dict[str, list[int]] = {r["id"]: [] for r in requests}
    for r in requests:
        engine.add_request(r["id"], r["ids"], r["params"])
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter()
            outputs[o.request_id].extend(o.new_token_ids)
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = (now, o.num_output_tokens)
    wall = time.perf_counter() - start
    steps = engine.drain().steps
    decode = [s for s in steps if s.num_decode_reqs and not s.prefill_tokens]
    gained = sum(s.num_decode_reqs + sum(s.accepted_per_seq) for s in decode)
    seconds = sum(s.duration_s for s in decode)
    tpots = [(t - first[rid]) / (n - 1) for rid, (t, n) in done.items() if n >= 2]
    nodes = [n for s in decode for n in s.nodes_per_seq]
    return {
        "policy": policy, "batch": batch, "requests": len(requests),
        "output_tokens": sum(len(o) for o in outputs.values()), "wall_s": wall,
        "decode_tokens_per_s": gained / seconds if seconds else 0.0,
        "e2e_tokens_per_s": sum(len(o) for o in outputs.values()) / wall,
        "mean_tpot_s": statistics.fmean(tpots) if tpots else None, "tpots_s": tpots,
        "mean_batch": statistics.fmean(s.num_decode_reqs for s in decode) if decode else 0.0,
        "mean_nodes_per_seq": statistics.fmean(nodes) if nodes else 0.0,
        "mean_accepted_length": gained / max(1, sum(s.num_decode_reqs for s in decode)),
        "steps_by_nodes": steps_by_nodes(decode),
        # Per-request budgets only (the estimates, in hindsight): [P bin] -> (offered nodes, on
        # the output's path), and the draft tokens per decoding sequence and step the offers held.
        **({"reliability": engine.budget.reliability.tolist(),
            "offered_accepted_per_seq": engine.budget.offered_accepted / max(1, sum(s.num_decode_reqs for s in decode))}
           if policy == BUDGETED else {}),
        "greedy_outputs": {r["id"]: outputs[r["id"]] for r in requests if r["greedy"]},
        # Not for the report (main drops them): every output (bench.budget_replay's), the planner.
        "outputs": outputs, "planner": engine.budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the engine's weights (bfloat16: what `dtype: auto` picks on a CPU where it is faster)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-model", default=None,
                        help="draft with this model (a name or folder, e.g. smollm2-135m-instruct-draft) "
                             "instead of prompt lookup")
    parser.add_argument("--out", default="bench/results/budget-cpu")
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    policies = args.policies.split(",")
    if BUDGETED not in policies or len(policies) < 2:
        parser.error(f"--policies needs {BUDGETED} and at least one static policy")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = machine.describe()
    folder = Path(resolve_model(MODEL, prepare=False))
    base = NativeEngine.from_pretrained(MODEL, dtype=getattr(torch, args.dtype),
                                        config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
    draft = None
    if args.draft_model:
        draft = load_model(resolve_model(args.draft_model, prepare=False), dtype=getattr(torch, args.dtype)
                           ).prepare_for_serving()
    sets = {b: request_set(REQUESTS[b], args.seed, args.max_tokens, folder) for b in batches}
    run(base, "off", sets[batches[0]][:1], 1)  # warm-up: allocator, thread pool, weights
    warm = {}
    for b in batches:
        calibrated = engine_for(base, BUDGETED, b, draft)
        seconds = calibrated.calibrate_step_cost()  # as a serving replica does at start
        w = run(base, BUDGETED, request_set(REQUESTS[b], args.seed, args.max_tokens, folder, split="train"), b,
                calibrated.budget, draft)
        warm[b] = w["planner"]
        print(f"[budget] warm-up of {BUDGETED} at batch {b}: step cost calibrated in {seconds:.1f} s, then "
              f"{w['decode_tokens_per_s']:.1f} tok/s (train split, not scored)", flush=True)
    runs: list[dict] = []
    total = args.rounds * len(batches) * len(policies)
    for rnd in range(args.rounds):
        for batch in batches:
            order = policies[rnd % len(policies):] + policies[: rnd % len(policies)]
            for policy in order:
                # Each round draws the sampled requests' outputs afresh: with the same seeds every
                # round repeats each policy's own outputs, and the rounds' spread leaves out how
                # much a cell depends on which outputs its policy happened to draw.
                r = run(base, policy, redrawn(sets[batch], rnd), batch, warm[batch] if policy == BUDGETED else None,
                        draft)
                for key in ("planner", "outputs"):
                    r.pop(key)
                r["round"] = rnd
                runs.append(r)
                print(f"[budget] {len(runs)}/{total} round {rnd} batch {batch:2d} {policy:12s} "
                      f"decode {r['decode_tokens_per_s']:6.1f} tok/s  e2e {r['e2e_tokens_per_s']:6.1f}  "
                      f"TPOT {1e3 * (r['mean_tpot_s'] or 0):6.1f} ms  nodes/seq {r['mean_nodes_per_seq']:.2f}  "
                      f"accepted length {r['mean_accepted_length']:.2f}", flush=True)
    host.update(machine.at_end(host))
    summary = summarize(runs, batches, policies, args.rounds)
    report = {"model": MODEL, "dtype": args.dtype, "threads": args.threads,
              "drafter": args.draft_model or "ngram (prompt lookup)",
              "command": " ".join(sys.argv[1:]), "machine": host, "requests": {b: REQUESTS[b] for b in batches},
              "max_tokens": args.max_tokens, "rounds": args.rounds, "summary": summary,
              "runs": [{k: v for k, v in r.items() if k != "greedy_outputs"} for r in runs], "time": time.time()}
    (out / "native_budget.json").write_text(json.dumps(report, indent=2))
    print_table(summary)
    plot(runs, summary, out)
    print(f"[budget] wrote {out}/native_budget.json and native_budget.png", flush=True)


def summarize(runs: list[dict], batches: tuple[int, ...], policies: list[str], rounds: int) -> list[dict]:
    select, score = split_rounds(rounds)
    rows = []
    for batch in batches:
        cell = {p: [r for r in runs if r["batch"] == batch and r["policy"] == p] for p in policies}
        statics = [p for p in policies if p != BUDGETED]
        best = max(statics, key=lambda p: statistics.fmean(cell[p][i]["decode_tokens_per_s"] for i in select))
        ratios = [cell[BUDGETED][i]["decode_tokens_per_s"] / cell[best][i]["decode_tokens_per_s"] for i in score]
        tpot = bootstrap_ratio([cell[best][i]["tpots_s"] for i in score], [cell[BUDGETED][i]["tpots_s"] for i in score],
                               mean)
        greedy_same = all(cell[BUDGETED][i]["greedy_outputs"] == cell["off"][i]["greedy_outputs"]
                          for i in range(rounds)) if "off" in cell else None
        rows.append({
            "batch": batch, "best_static": best, "scoring_rounds": score,
            "decode_tokens_per_s": {p: statistics.fmean(r["decode_tokens_per_s"] for r in cell[p]) for p in policies},
            "mean_tpot_ms": {p: 1e3 * statistics.fmean(t for r in cell[p] for t in r["tpots_s"]) for p in policies},
            "throughput_ratio": statistics.fmean(ratios), "throughput_ratio_min": min(ratios),
            "throughput_ratio_max": max(ratios),
            "tpot_speedup": {"ratio": tpot.ratio, "low": tpot.low, "high": tpot.high},
            "goal": GOAL.get(batch, 1.0),
            "verdict": verdict(min(ratios), max(ratios), tpot, GOAL.get(batch, 1.0)),
            "greedy_outputs_equal_off": greedy_same,
            "auto_estimates": estimate_reliability(cell[BUDGETED]),
            "step_profile": {p: step_profile(cell[p]) for p in (BUDGETED, best)},
        })
    return rows


def estimate_reliability(runs: list[dict]) -> dict:
    """How good `auto`'s P(accepted) was, judged in hindsight over every node its sequences
    offered (native_engine/budget.py): per bin of P, the share the outputs went through; and the
    draft tokens per sequence and step it accepted against those its offers held."""
    counts = [[sum(r["reliability"][b][k] for r in runs) for k in (0, 1)] for b in range(len(runs[0]["reliability"]))]
    bins = len(counts)
    return {
        "bins": [{"p_low": b / bins, "p_high": (b + 1) / bins, "nodes": int(n), "on_path_rate": hit / n if n else None}
                 for b, (n, hit) in enumerate(counts)],
        "accepted_per_seq": statistics.fmean(r["mean_accepted_length"] - 1 for r in runs),
        "offered_accepted_per_seq": statistics.fmean(r["offered_accepted_per_seq"] for r in runs),
    }


def verdict(low: float, high: float, tpot, goal: float) -> str:
    """met: every scoring round's throughput ratio clears the goal and TPOT is no worse (its
    interval reaches 1 or above); missed: every round falls short; inconclusive otherwise."""
    if low >= goal and tpot.high >= 1.0:
        return "met"
    if high < goal or tpot.high < 1.0:
        return "missed"
    return "inconclusive"


def print_table(summary: list[dict]) -> None:
    policies = list(summary[0]["decode_tokens_per_s"])
    print("\nbatch | " + " | ".join(policies) + " | best static | auto / best tok/s (rounds) | best / auto TPOT [95%] | goal")
    for row in summary:
        cells = " | ".join(f"{row['decode_tokens_per_s'][p]:.1f}" for p in policies)
        t = row["tpot_speedup"]
        print(f"{row['batch']} | {cells} | {row['best_static']} | {row['throughput_ratio']:.2f} "
              f"[{row['throughput_ratio_min']:.2f}, {row['throughput_ratio_max']:.2f}] | "
              f"{t['ratio']:.2f} [{t['low']:.2f}, {t['high']:.2f}] | >= {row['goal']}: {row['verdict']}")
    for row in summary:
        est = row["auto_estimates"]
        bins = "  ".join(f"{b['p_low']:.1f}-{b['p_high']:.1f}: {b['on_path_rate']:.2f} ({b['nodes']})"
                         for b in est["bins"] if b["nodes"])
        print(f"batch {row['batch']}: {BUDGETED} accepted {est['accepted_per_seq']:.2f} draft tokens per sequence "
              f"and step; its offers held {est['offered_accepted_per_seq']:.2f}. Its P(accepted), in hindsight "
              f"(bin: share accepted (nodes)): {bins}")
    for row in summary:
        for policy, buckets in row["step_profile"].items():
            cells = "  ".join(f"{b['nodes_per_seq']}: {b['step_share']:.0%} of steps, {b['time_share']:.0%} of time, "
                              f"{b['ms_per_step']:.0f} ms, {b['tokens_per_s']:.0f} tok/s" for b in buckets)
            print(f"batch {row['batch']} {policy} steps by draft nodes per sequence: {cells}")


def plot(runs: list[dict], summary: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(summary[0]["decode_tokens_per_s"])
    fig, axes = plt.subplots(1, len(summary), figsize=(4.5 * len(summary), 4), squeeze=False)
    for ax, row in zip(axes[0], summary):
        for x, p in enumerate(policies):
            values = [r["decode_tokens_per_s"] for r in runs if r["batch"] == row["batch"] and r["policy"] == p]
            ax.scatter([x] * len(values), values, s=14, color="tab:red" if p == BUDGETED else "tab:blue")
            ax.bar(x, statistics.fmean(values), alpha=0.3, color="tab:red" if p == BUDGETED else "tab:blue")
        ax.set_xticks(range(len(policies)), policies, rotation=45, ha="right")
        ax.set_title(f"batch {row['batch']}: auto / {row['best_static']} = {row['throughput_ratio']:.2f}")
        ax.set_ylabel("decode tokens/s")
    fig.suptitle("Per-request budgets (auto) vs static policies, mixed chat + code edit (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(out / "native_budget.png", dpi=120)


if __name__ == "__main__":
    main()
