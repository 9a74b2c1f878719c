"""`adaspec eval-draft`: acceptance per position, mean accepted length for k = 1..8 and the
draft/target cost ratio of a draft model (distill/pipeline.py); torch is imported only when
it runs."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval-draft", help="acceptance and cost of a draft model for a target")
    p.add_argument("--target", required=True, help="embedded model name or folder")
    p.add_argument("--draft", required=True, help="draft model name or folder")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "humaneval"],
                   help="held-out prompts to measure on (test split)")
    p.add_argument("--prompts", type=int, default=40, help="held-out prompts (test split)")
    p.add_argument("--max-tokens", type=int, default=128, help="target tokens per held-out prompt")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from distill.pipeline import eval_draft

    torch.set_num_threads(args.threads)
    result = eval_draft(args.target, args.draft, args.dataset, args.prompts, args.max_tokens)
    print(json.dumps(dataclasses.asdict(result), indent=2) if args.json else result.table())
    return 0
