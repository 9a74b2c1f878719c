"""`adaspec simulate`: a discrete-event simulation of N replicas, the controller and the
request router (controller/simulate.py), its engines fitted from an `adaspec profile`, a
controller checkpoint, or the prior roofline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.arguments import probability_list
from controller.simulate import ROUTINGS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate N replicas and the controller")
    p.add_argument("--replicas", type=int, default=1, help="simulated replicas, each with its own engine")
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    p.add_argument("--rate", type=float, required=True, help="requests/s over all replicas")
    p.add_argument("--profile", help="steps from `adaspec profile` to fit the models on")
    p.add_argument("--checkpoint", help="a controller checkpoint (default: the local controller's)")
    p.add_argument("--policy", help="a static policy instead of the controller")
    p.add_argument("--acceptance", type=float, default=0.6, help="per-position rate without data")
    p.add_argument("--max-batch", type=int, default=32, help="largest running batch per replica (requests)")
    p.add_argument("--max-k", type=int, default=4, help="deepest chain the simulated engines run (tokens)")
    p.add_argument("--output-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=200, help="prompt tokens per request")
    p.add_argument("--period", type=float, default=1.0, help="control period (seconds)")
    p.add_argument("--warmup", type=float, default=0.0, help="ignore requests arriving before (seconds)")
    p.add_argument("--seed", type=int, default=0,
                   help="arrival times (the same for every router), routing and acceptance draws")
    p.add_argument("--routing", choices=ROUTINGS, default="random",
                   help="how requests are split among replicas, at their arrival: random (uniformly), power_of_two "
                   "(Ray Serve's default: the one of two random replicas with fewer ongoing requests), spec_aware "
                   "(adaspec's router: least predicted completion time from the replicas' routing stats); "
                   "default random")
    p.add_argument("--routing-stats-period", type=float, default=0.5,
                   help="seconds between the replicas' routing stats for spec_aware (the app's: 0.5)")
    p.add_argument("--replica-acceptance", metavar="RATES",
                   help="drafters that differ per replica: comma-separated acceptance rates per draft position, "
                   "replica i gets the (i mod count)-th, e.g. 0.9,0.4,0.4 (one replica in three drafts well); "
                   "default: every replica the models' (or --acceptance)")
    p.add_argument("--compare-routing", action="store_true",
                   help="run every router on the same arrivals (same --seed) and print mean and p99 latency "
                   "with their ratios to power_of_two")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _engine(args: argparse.Namespace):
    """The simulated engine and where its models came from: --profile, else the checkpoint
    (--checkpoint or the local controller's), else the prior roofline."""
    from controller.checkpoint_file import CHECKPOINT_FILE, LEGACY_FILE, checkpoint_dir
    from controller.config import ControllerConfig
    from controller.simulate import SimulatedEngine, engine_from_checkpoint, engine_from_profile
    from controller.step_time import StepTimeModel

    if args.profile:
        return engine_from_profile(args.profile, args.max_batch, args.max_k), f"profile {args.profile}"
    ckpt = Path(args.checkpoint) if args.checkpoint else checkpoint_dir(ControllerConfig()) / CHECKPOINT_FILE
    if not args.checkpoint and not ckpt.is_file() and ckpt.with_name(LEGACY_FILE).is_file():
        ckpt = ckpt.with_name(LEGACY_FILE)  # not converted yet: reading it says how
    if ckpt.is_file():
        return engine_from_checkpoint(str(ckpt), args.max_batch, args.max_k), f"controller checkpoint {ckpt}"
    engine = SimulatedEngine.from_models(StepTimeModel(), [args.acceptance] * args.max_k, args.max_batch, args.max_k)
    return engine, "prior roofline (no profile or checkpoint found)"


def run(args: argparse.Namespace) -> int:
    from controller.config import ControllerConfig
    from controller.simulate import simulate

    engine, source = _engine(args)
    controller = None if args.policy else ControllerConfig(enabled=True, period_s=args.period)
    acceptance = probability_list(args.replica_acceptance, "--replica-acceptance") if args.replica_acceptance else None
    routings = ROUTINGS if args.compare_routing else (args.routing,)
    if not args.json:
        print(f"simulating {args.replicas} replicas for {args.duration:.0f} s at {args.rate} req/s; "
              f"models from {source}; {'policy ' + args.policy if args.policy else 'adaptive controller'}"
              + (f"; drafter acceptance per replica {acceptance} (repeated)" if acceptance else ""))
    results = {}
    for routing in routings:
        # One seed, so every router gets the same arrival times.
        results[routing] = simulate(
            engine, args.replicas, args.duration, args.rate, controller=controller, policy=args.policy or "chain2",
            seed=args.seed, output_tokens=args.output_tokens, prompt_tokens=args.prompt_tokens,
            period_s=args.period, warmup_s=args.warmup, routing=routing,
            routing_stats_period_s=args.routing_stats_period, replica_acceptance=acceptance)
    if args.json:
        if args.compare_routing:
            print(json.dumps({r: res.model_dump() for r, res in results.items()}, indent=2))
        else:
            print(results[args.routing].model_dump_json(indent=2))
        return 0
    _print_results(results, args.compare_routing)
    return 0


def _print_results(results: dict, compare: bool) -> None:
    for routing, result in results.items():
        print(f"{routing}: simulated {result.simulated_s:.0f} s in {result.wall_s:.1f} s ({result.speed:.2f}x real "
              f"time, {result.cpu_s:.1f} CPU s); {result.completed} requests; latency mean "
              f"{result.mean_latency_s:.3f} s, p50 {result.p50_latency_s:.3f} s, p99 {result.p99_latency_s:.3f} s"
              + (f"; {result.fallback_routes} routed by power of two (no stats yet)" if result.fallback_routes else ""))
        for policy, n in result.final_policies.items():
            print(f"  {n} replicas end on {policy}")
    if compare:
        base = results["power_of_two"]
        print("| router | mean latency (s) | p99 latency (s) | mean / power_of_two | p99 / power_of_two |")
        print("|---|---|---|---|---|")
        for routing, r in results.items():
            print(f"| {routing} | {r.mean_latency_s:.3f} | {r.p99_latency_s:.3f} | "
                  f"{r.mean_latency_s / base.mean_latency_s:.3f} | {r.p99_latency_s / base.p99_latency_s:.3f} |")
