"""The operator CLI: `adaspec <command>`.

  prepare-models              install and convert the embedded models (idempotent)
  distill-draft --target MODEL --out DIR [--layers L --hidden H --tokens N --budget-minutes M --resume]
                              train a small draft model on the target's own outputs and logits
  distill-eagle --target MODEL --out DIR [--draft-vocab V --epochs E --budget-minutes M]
                              train an EAGLE-3 head on the target's hidden states (vLLM method: eagle3)
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
  peer --out DIR [--loads stream,0.5,2,inf --rounds 3]   adaspec against plain vLLM (with and
                              without static speculation) and Ray Serve LLM, alternated (bench/peer.py)

Every command that prints a table also prints JSON with --json.
"""

from __future__ import annotations

import argparse
import logging
import sys

from adaspec.models import ModelError
from adaspec.policy import PolicyError
from cli import (bench, controller, distill_draft, distill_eagle, eval_draft, peer, policy, prepare_models, profile, serve, simulate,
                 status, sweep)
from cli.arguments import UsageError
from cli.serve_config import ConfigError
from controller.checkpoint_file import CheckpointError
from distill import DistillError
from serve_app import admin_client

# In the order `adaspec --help` lists them; each module adds its parser (`add_parser`) and
# runs the command (`run(args) -> exit status`).
COMMANDS = (prepare_models, distill_draft, distill_eagle, eval_draft, serve, status, controller, profile, simulate, policy, bench,
            sweep, peer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaspec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
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
