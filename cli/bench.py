"""`adaspec bench`: load-test any OpenAI-compatible endpoint with one dataset at one rate
(bench/harness.py): TTFT, TPOT, ITL, E2E, throughput, goodput, and the replicas'
acceptance and k."""

from __future__ import annotations

import argparse
from pathlib import Path

from adaspec.datasets import DATASETS
from cli.arguments import UsageError, add_url, add_workload, check_dataset, positive, request_mix


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    add_url(p)
    p.add_argument("--dataset", required=True, choices=list(DATASETS), help="prompts (test split)")
    p.add_argument("--rate", type=float, required=True, help="requests per second (inf: all at once)")
    p.add_argument("--num-prompts", type=int, required=True, help="requests to send")
    add_workload(p)
    p.add_argument("--out", help="folder for the result JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.harness import BenchError, BenchSettings, format_summary, run_bench, save

    positive(args.rate, "--rate")
    positive(args.num_prompts, "--num-prompts")
    positive(args.burstiness, "--burstiness")
    positive(args.max_tokens, "--max-tokens")
    check_dataset(args.dataset, args.num_prompts, args.seed)
    settings = BenchSettings(url=args.url, dataset=args.dataset, rate=args.rate, num_prompts=args.num_prompts,
                             burstiness=args.burstiness, max_tokens=args.max_tokens, seed=args.seed,
                             request_mix=request_mix(args),
                             slo_ttft_s=args.slo_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000)
    try:
        result = run_bench(settings, progress=not args.json, token=args.token)
    except BenchError as e:
        raise UsageError(str(e)) from None
    path = save(result, Path(args.out)) if args.out else None
    if args.json:
        print(result.model_dump_json(indent=2))
    else:
        print(format_summary(result))
        if path:
            print(f"result: {path}")
    return 0 if result.metrics.errors == 0 else 1
