"""`adaspec distill-eagle`: train an EAGLE-3 head for a target on its own hidden states
(distill/eagle3_pipeline.py) and write it as vLLM loads it; torch is imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from distill import DistillError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill-eagle", help="train an EAGLE-3 draft head for a target (vLLM method: eagle3)")
    p.add_argument("--target", required=True, help="embedded model name or Llama-family folder")
    p.add_argument("--out", required=True, help="folder to write (empty, new, or an earlier head)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (tokens the head can propose)")
    p.add_argument("--conversations", type=int, default=1500, help="ShareGPT train conversations to train on")
    p.add_argument("--no-code", action="store_true", help="leave out HumanEval and code-edit train records")
    p.add_argument("--epochs", type=float, default=4.0, help="passes over the data (the budget may end it sooner)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled per position (training-time test)")
    p.add_argument("--budget-minutes", type=float, default=90.0, help="wall-clock budget of the whole command")
    p.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts for the card's numbers")
    p.add_argument("--eval-max-tokens", type=int, default=128, help="target tokens per held-out prompt")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from distill.eagle3_pipeline import EagleRequest, distill_eagle
    from distill.eagle3_train import HeadTrainSettings

    for flag, value in (("--draft-vocab", args.draft_vocab), ("--conversations", args.conversations),
                        ("--ttt-steps", args.ttt_steps), ("--eval-prompts", args.eval_prompts)):
        if value < 1:
            raise DistillError(f"{flag}: must be positive, got {value}")
    if args.budget_minutes <= 0 or args.epochs <= 0:
        raise DistillError("--budget-minutes and --epochs: must be positive")
    torch.set_num_threads(args.threads)
    req = EagleRequest(target=args.target, out=Path(args.out), draft_vocab=args.draft_vocab,
                       conversations=args.conversations, code=not args.no_code, epochs=args.epochs,
                       budget_minutes=args.budget_minutes, eval_prompts=args.eval_prompts,
                       eval_max_new_tokens=args.eval_max_tokens,
                       train=replace(HeadTrainSettings(), steps=args.ttt_steps),
                       command_line="adaspec distill-eagle " + " ".join(shlex.quote(a) for a in sys.argv[2:]))
    out, result, state = distill_eagle(req)
    print(f"head written to {out} ({state.positions:,} positions, {state.seconds / 60:.1f} min of training)")
    print(result.table())
    return 0
