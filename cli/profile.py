"""`adaspec profile`: a step-time profiling sweep against a live adaspec server.

For every speculation length k and batch size B of the grid, the sweep pushes the policy
`chainK` to every replica (the controller is paused meanwhile), sends B requests at once and
collects the engine steps they caused from the replicas' telemetry. The requests are served
traffic, as `adaspec bench` sends it: prompts from the train split of `--dataset` (the
benchmarks draw from the test split), the realistic mix of greedy and T=0.7 requests, each
stopping at EOS or at its dataset's reply length (bench/client.py). A profile of short fixed
prompts run greedy to `max_tokens` priced large batches by a fifth of a served context
(docs/controller.md) and overstated what speculation buys (docs/benchmarks.md). It saves the steps (JSON lines
`{"model_id", "step"}`, the format `controller.profile_path` reads), fits the step-time
model, and reports its error on held-out steps.

`add_parser` and `run` are the command; the benchmark client is imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from adaspec.datasets import DATASETS
from adaspec.policy import SpecConfig
from adaspec.telemetry import ProfiledStep
from cli.arguments import add_url, int_list
from controller.step_time import StepTimeModel
from serve_app import admin_client


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="step-time sweep against a live server")
    add_url(p)
    p.add_argument("--out", required=True, help="folder for steps.jsonl and profile.json")
    p.add_argument("--ks", default="0,1,2,3,4", help="speculation lengths to sweep")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes to sweep")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="cap on output tokens per request (each also stops at EOS and at its dataset's reply length)")
    p.add_argument("--dataset", default="mixed", choices=DATASETS, help="prompts (train split)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summary = profile(args.url, Path(args.out), int_list(args.ks, "--ks"),
                      int_list(args.batches, "--batches"), args.max_tokens, token=args.token, dataset=args.dataset)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


def _run_batch(url: str, model: str, dataset: str, batch: int, max_tokens: int, seed: int) -> None:
    """`batch` requests of `dataset` (train split, drawn by `seed`) at once, decoded as the
    realistic mix says; raises AdminError when one fails."""
    import asyncio

    from bench.client import RequestMix, run_load
    from bench.harness import reply_token_caps
    from prepare.datasets import load_prompts

    prompts = load_prompts(dataset, batch, seed, split="train")
    caps = reply_token_caps(prompts, model, max_tokens)
    results = asyncio.run(run_load(url, model, prompts, [0.0] * batch, caps, progress=False,
                                   sampling=RequestMix().samplings(batch, seed)))
    errors = [r.error for r in results if r.error]
    if errors:
        raise admin_client.AdminError(f"profiling requests failed: {errors[0]}")


def profile(url: str, out: Path, ks: list[int], batches: list[int], max_tokens: int = 64,
            token: str | None = None, log=print, dataset: str = "mixed") -> dict:
    """Run the sweep; write out/steps.jsonl and out/profile.json; return the summary."""
    from bench.client import RequestMix
    from bench.machine import describe

    out.mkdir(parents=True, exist_ok=True)
    reports = admin_client.status(url, token)
    if not reports:
        raise admin_client.AdminError("no replicas answered")
    model_id = reports[0].model_id
    caps = reports[0].info.capabilities  # the status route always sends the info
    ks = [k for k in ks if k <= caps.max_k]
    batches = [b for b in batches if b <= caps.max_batch_size]
    original = str(reports[0].policy)
    controller = admin_client.controller_view(url, token)
    if controller is not None and not controller.paused:
        admin_client.controller_action(url, "pause", token)
    cells, steps_file = [], out / "steps.jsonl"
    machine = describe()
    model = StepTimeModel()
    try:
        with steps_file.open("w") as f:
            for i, (k, batch) in enumerate([(k, b) for k in ks for b in batches]):
                admin_client.set_policy(url, str(SpecConfig.chain(k)), token)
                start = time.time()
                _run_batch(url, model_id, dataset, batch, max_tokens, seed=batch)  # the same requests for every k
                steps = [s for r in admin_client.status(url, token) for s in r.steps if s.time > start]
                for s in steps:
                    f.write(ProfiledStep(model_id=model_id, step=s).model_dump_json() + "\n")
                model.add(steps)
                mean_ms = 1000 * sum(s.duration_s for s in steps) / max(len(steps), 1)
                cells.append({"k": k, "batch": batch, "steps": len(steps), "mean_step_ms": mean_ms})
                log(f"[{i + 1}/{len(ks) * len(batches)}] chain{k} batch {batch}: {len(steps)} steps, "
                    f"mean {mean_ms:.1f} ms")
    finally:
        admin_client.set_policy(url, original, token)
        if controller is not None and not controller.paused:
            admin_client.controller_action(url, "resume", token)
    fit = model.fit()
    summary = {"model_id": model_id, "url": url, "ks": ks, "batches": batches, "max_tokens": max_tokens,
               "dataset": dataset, "requests": RequestMix().describe(max_tokens), "machine": machine,
               "cells": cells, "fit": {"kind": fit.kind, "samples": fit.samples,
                                       "holdout_samples": fit.holdout_samples, "holdout_mape": fit.holdout_mape},
               "steps_file": str(steps_file)}
    (out / "profile.json").write_text(json.dumps(summary, indent=2))
    log(f"step-time model: {fit.kind} on {fit.samples} steps; held-out error (MAPE) "
        f"{100 * fit.holdout_mape:.1f}% on {fit.holdout_samples} steps")
    return summary

