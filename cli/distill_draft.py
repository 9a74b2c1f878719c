"""`adaspec distill-draft`: train a small draft model on the target's own outputs and logits
(distill/pipeline.py); torch is imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distill import DistillError


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
