"""What adaspec's scheduler hooks (policy table + per-step StepRecord) cost per engine step.

Two vLLM engines in one process, identical but for the scheduler: vLLM's own `Scheduler`
(off) and `AdaspecScheduler` (on), both with the same speculation table. The same batch of
greedy requests runs on each in ABBA order, so machine drift hits both alike; the ratio of
wall times per step (identical step counts: same greedy outputs, same table) is printed.

    python -m bench.telemetry_overhead [--rounds 8 --batch 8 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from prepare.models import resolve_model
from adaspec.policy import SpecPolicy
from serve_app.vllm_engine import SCHEDULER_CLS

PROMPTS = [
    "one two three four five six, one two three four five six, one two",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List the planets of the solar system:",
]


def make_llm(scheduler_cls: str | None, max_k: int, policy: SpecPolicy, max_num_seqs: int):
    from vllm import LLM

    kwargs = {"scheduler_cls": scheduler_cls} if scheduler_cls else {}
    return LLM(
        model=resolve_model("smollm2-135m-instruct"), dtype="float32", max_model_len=1024,
        max_num_seqs=max_num_seqs, kv_cache_memory_bytes=1 << 30, disable_log_stats=False,
        speculative_config={
            "method": "ngram", "num_speculative_tokens": max_k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
            "num_speculative_tokens_per_batch_size": policy.to_vllm_table(max_num_seqs),
        },
        **kwargs,
    )


def timed_run(llm, prompts: list[str], tokens: int) -> tuple[float, list[str]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].text for o in outputs]


def count_steps(llm) -> int:
    """Steps recorded by AdaspecScheduler since the last drain (drains them)."""
    raw = llm.llm_engine.engine_core.call_utility("scheduler", "drain", "")
    return len(json.loads(raw)["steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="ABBA rounds")
    parser.add_argument("--batch", type=int, default=8, help="requests per run")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--policy", default="1-2:chain4,3-8:chain2,9+:off")
    args = parser.parse_args()

    policy = SpecPolicy.parse(args.policy)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    engines = {"off": make_llm(None, 4, policy, 32), "on": make_llm(SCHEDULER_CLS, 4, policy, 32)}
    for llm in engines.values():  # warm-up
        timed_run(llm, prompts, 8)
    count_steps(engines["on"])

    times: dict[str, list[float]] = {"off": [], "on": []}
    texts: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            seconds, texts[name] = timed_run(engines[name], prompts, args.tokens)
            times[name].append(seconds)
        print(f"round {r + 1}/{args.rounds}: off {times['off'][-1]:.3f} s, on {times['on'][-1]:.3f} s",
              flush=True)
    steps = count_steps(engines["on"]) / args.rounds
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    result = {
        "steps_per_run": steps,
        "median_step_ms_off": 1000 * statistics.median(times["off"]) / steps,
        "median_step_ms_on": 1000 * statistics.median(times["on"]) / steps,
        "median_ratio_on_over_off": statistics.median(ratios),
        "ratios": ratios,
        "identical_outputs": texts["on"] == texts["off"],
    }
    print(json.dumps(result, indent=2))
    print(f"overhead: {100 * (result['median_ratio_on_over_off'] - 1):+.2f}% per step "
          f"({result['median_step_ms_on']:.1f} ms vs {result['median_step_ms_off']:.1f} ms, "
          f"{steps:.0f} steps per run, {args.rounds} ABBA rounds)")


if __name__ == "__main__":
    main()
