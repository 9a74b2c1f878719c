"""`adaspec sweep`: every policy at every rate on one deployment it starts itself
(bench/sweep.py); writes results.json, report.md and plots (bench/report.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adaspec.datasets import DATASETS
from adaspec.models import DEFAULT_MODEL
from adaspec.policy import PolicyError
from cli.arguments import UsageError, add_workload, check_dataset, name_list, positive, rate_list, request_mix, split_list


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="every policy at every rate on one deployment")
    p.add_argument("--config", default="configs/app.yaml", help="Ray Serve config to start (a copy is used)")
    p.add_argument("--policies", default="off,chain1,chain2,chain3,chain4,table:profiled,adaptive",
                   help='off, chainK, table:profiled, table:"1-2:chain4,3+:off", adaptive')
    p.add_argument("--rates", default="0.5,1,2,inf",
                   help="requests per second, comma-separated; `none` with --phase-trace: the trace alone")
    p.add_argument("--dataset", default="sharegpt", help=f"comma-separated, of: {', '.join(DATASETS)}")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts per run")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of every cell (new prompts each); with 2+ the report gives 95%% "
                        "intervals and picks the oracle on held-out rounds")
    add_workload(p)
    p.add_argument("--profile", default=None,
                   help="`adaspec profile` steps for table:profiled (and the controller's start model); "
                   "default: the profile adaspec ships for the default model on vLLM")
    p.add_argument("--phase-trace", default=None,
                   help="also run this DATASET:RATE:SECONDS,... trace under every policy")
    p.add_argument("--cross-check-rate", default=None,
                   help="also compare with vLLM's `bench serve` at this rate (ShareGPT, policy off)")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md and plots from results.json")
    p.add_argument("--out", required=True, help="folder for results.json, report.md and the plots")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bench.policies import resolve
    from bench.report import write_report
    from bench.sweep import Sweep, SweepSettings
    from prepare.models import shipped_profile

    if not Path(args.config).is_file():
        raise UsageError(f"--config: no such file {args.config!r}")
    if args.rates.strip().lower() == "none":  # the phase-change trace alone
        if not args.phase_trace:
            raise UsageError("--rates none: only with --phase-trace (then the sweep runs the trace alone)")
        rates = []
    else:
        rates = rate_list(args.rates, "--rates")
    datasets = name_list(args.dataset, "--dataset", DATASETS)
    positive(args.num_prompts, "--num-prompts")
    positive(args.rounds, "--rounds")
    positive(args.max_tokens, "--max-tokens")
    if args.profile is None:  # the default model's shipped profile, where there is one
        shipped = shipped_profile(DEFAULT_MODEL, "vllm")
        args.profile = str(shipped) if shipped else None
    try:
        policies = resolve(split_list(args.policies, "--policies"), Path(args.profile) if args.profile else None)
    except PolicyError as e:
        raise UsageError(f"--policies: {e}") from None
    for d in datasets:
        check_dataset(d, args.num_prompts, args.seed)
    if args.phase_trace:
        from bench.phase import parse_trace

        try:
            parse_trace(args.phase_trace)
        except ValueError as e:
            raise UsageError(f"--phase-trace: {e}") from None
    settings = SweepSettings(config=args.config, policies=[p.name for p in policies], rates=rates,
                             datasets=datasets, num_prompts=args.num_prompts, rounds=args.rounds,
                             max_tokens=args.max_tokens,
                             request_mix=request_mix(args),
                             seed=args.seed, burstiness=args.burstiness, slo_ttft_s=args.slo_ttft_ms / 1000,
                             slo_tpot_s=args.slo_tpot_ms / 1000, profile=args.profile,
                             phase_trace=args.phase_trace,
                             cross_check_rate=None if args.cross_check_rate is None
                             else rate_list(args.cross_check_rate, "--cross-check-rate")[0],
                             out=args.out)
    if args.report_only:
        print(write_report(Path(args.out)))
        return 0
    Sweep(settings, policies, ["adaspec"] + sys.argv[1:]).run()
    print(write_report(Path(args.out)))
    return 0
