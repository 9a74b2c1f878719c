"""The operator CLI: `adaspec <command>`.

  prepare-models              install and convert the embedded models (idempotent)
  serve [CONFIG]              check a Serve config, then `serve run` it (default configs/app.yaml)
  status  --url URL [--json] [--watch S]  per replica: policy, batch sizes, acceptance, step
                              time; and the controller's view (rate, chosen policy, predicted vs
                              measured step time)
  controller show|pause|resume --url URL   the adaptive controller
  simulate --replicas N --duration S --rate R [--json]   discrete-event simulation of N
                              replicas and the controller, from fitted models
  profile --url URL --out DIR  step-time sweep (k x batch) against a live server; fits and
                              reports the step-time model's held-out error
  policy set --url URL --table "1-2:chain4,3-8:chain2,9+:off"   push a policy to every replica
  policy show --url URL       the policy in force on every replica

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

from adaspec import admin_client
from adaspec.models import EMBEDDED_MODELS, ModelError, model_folder, prepare_model
from adaspec.policy import PolicyError, SpecPolicy
from adaspec.serve_config import ConfigError


def _cmd_prepare_models(args: argparse.Namespace) -> int:
    names = args.names or sorted(EMBEDDED_MODELS)
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from adaspec.serve_config import check_serve_config

    check_serve_config(args.config)  # fail fast, naming the field; `serve run` would retry
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    os.execv(serve, [serve, "run", args.config])


def _cmd_status(args: argparse.Namespace) -> int:
    while True:
        reports = admin_client.status(args.url, token=args.token)
        view = admin_client.controller_view(args.url, token=args.token)
        if args.json:
            print(json.dumps({"replicas": [r.model_dump(mode="json") for r in reports],
                              "controller": view}, indent=2))
        else:
            if args.watch:
                print("\033[2J\033[H" + time.strftime("%H:%M:%S"), end="\n")
            print(admin_client.format_status(reports))
            print(admin_client.format_controller(view))
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _cmd_profile(args: argparse.Namespace) -> int:
    from adaspec.profile import profile

    summary = profile(args.url, Path(args.out), _int_list(args.ks, "--ks"),
                      _int_list(args.batches, "--batches"), args.max_tokens, token=args.token)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from controller.actor import CHECKPOINT_FILE, checkpoint_dir
    from controller.config import ControllerConfig
    from controller.simulate import SimulatedEngine, engine_from_checkpoint, engine_from_profile, simulate
    from controller.step_time import StepTimeModel

    if args.profile:
        engine = engine_from_profile(args.profile, args.max_batch, args.max_k)
        source = f"profile {args.profile}"
    else:
        ckpt = Path(args.checkpoint) if args.checkpoint else checkpoint_dir(ControllerConfig()) / CHECKPOINT_FILE
        if ckpt.is_file():
            engine = engine_from_checkpoint(str(ckpt), args.max_batch, args.max_k)
            source = f"controller checkpoint {ckpt}"
        else:
            engine = SimulatedEngine.from_models(StepTimeModel(), [args.acceptance] * args.max_k,
                                                 args.max_batch, args.max_k)
            source = "prior roofline (no profile or checkpoint found)"
    controller = None if args.policy else ControllerConfig(enabled=True, period_s=args.period)
    if not args.json:
        print(f"simulating {args.replicas} replicas for {args.duration:.0f} s at {args.rate} req/s; "
              f"models from {source}; {'policy ' + args.policy if args.policy else 'adaptive controller'}")
    result = simulate(engine, args.replicas, args.duration, args.rate, controller=controller,
                      policy=args.policy or "chain2", seed=args.seed, output_tokens=args.output_tokens,
                      prompt_tokens=args.prompt_tokens, period_s=args.period, warmup_s=args.warmup)
    if args.json:
        print(result.model_dump_json(indent=2))
    else:
        print(f"simulated {result.simulated_s:.0f} s in {result.wall_s:.1f} s ({result.speed:.2f}x real time); "
              f"{result.completed} requests; latency mean {result.mean_latency_s:.3f} s, "
              f"p50 {result.p50_latency_s:.3f} s, p99 {result.p99_latency_s:.3f} s")
        for policy, n in result.final_policies.items():
            print(f"  {n} replicas end on {policy}")
    return 0


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
    print(json.dumps(view, indent=2) if args.json else admin_client.format_controller(view))
    return 0


def _cmd_policy_set(args: argparse.Namespace) -> int:
    SpecPolicy.parse(args.table)  # fail here, naming the problem, before any request
    acks = admin_client.set_policy(args.url, args.table, token=args.token, version=args.version)
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in acks], indent=2))
    else:
        for a in acks:
            extra = f" ({a.message})" if a.message else ""
            print(f"replica {a.replica_id}: {a.status}; in force v{a.version_in_force}: {a.policy_in_force}{extra}")
    return 0 if all(a.status == "applied" for a in acks) else 1


def _cmd_policy_show(args: argparse.Namespace) -> int:
    reports = admin_client.status(args.url, token=args.token)
    rows = {r.replica_id: {"version": r.policy.version, "policy": str(r.policy)} for r in reports}
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for rid, row in rows.items():
            print(f"replica {rid}: v{row['version']} {row['policy']}")
    return 0


def _add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("ADASPEC_URL", "http://127.0.0.1:8000"),
                   help="adaspec HTTP endpoint (default $ADASPEC_URL or http://127.0.0.1:8000)")
    p.add_argument("--token", default=os.environ.get("ADASPEC_ADMIN_TOKEN"),
                   help="admin bearer token (default $ADASPEC_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", help="print JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaspec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-models", help="install and convert the embedded models")
    p.add_argument("names", nargs="*", help=f"models to prepare (default all: {sorted(EMBEDDED_MODELS)})")
    p.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_prepare_models)

    p = sub.add_parser("serve", help="check a Serve config and run it with `serve run`")
    p.add_argument("config", nargs="?", default="configs/app.yaml", help="Ray Serve config file")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("status", help="per-replica policy, acceptance and step time")
    _add_url(p)
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("controller", help="show, pause or resume the adaptive controller")
    p.add_argument("action", choices=["show", "pause", "resume"])
    _add_url(p)
    p.set_defaults(func=_cmd_controller)

    p = sub.add_parser("profile", help="step-time sweep against a live server")
    _add_url(p)
    p.add_argument("--out", required=True, help="folder for steps.jsonl and profile.json")
    p.add_argument("--ks", default="0,1,2,3,4", help="speculation lengths to sweep")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes to sweep")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("simulate", help="simulate N replicas and the controller")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds")
    p.add_argument("--rate", type=float, required=True, help="requests/s over all replicas")
    p.add_argument("--profile", help="steps from `adaspec profile` to fit the models on")
    p.add_argument("--checkpoint", help="a controller checkpoint (default: the local controller's)")
    p.add_argument("--policy", help="a static policy instead of the controller")
    p.add_argument("--acceptance", type=float, default=0.6, help="per-position rate without data")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--period", type=float, default=1.0, help="control period (seconds)")
    p.add_argument("--warmup", type=float, default=0.0, help="ignore requests arriving before (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_simulate)

    policy = sub.add_parser("policy", help="show or set the speculation policy").add_subparsers(
        dest="policy_command", required=True)
    p = policy.add_parser("set", help="push a policy table to every replica")
    _add_url(p)
    p.add_argument("--table", required=True, help='e.g. "1-2:chain4,3-8:chain2,9+:off" or "off"')
    p.add_argument("--version", type=int, default=None, help="policy version (default: now in ms)")
    p.set_defaults(func=_cmd_policy_set)
    p = policy.add_parser("show", help="the policy in force on every replica")
    _add_url(p)
    p.set_defaults(func=_cmd_policy_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelError, PolicyError, ConfigError, admin_client.AdminError, FileNotFoundError) as e:
        print(f"adaspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
