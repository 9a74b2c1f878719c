"""Decode tokens/s of fixed speculation policies at one stream and at a burst, on a running
server (the controller paused): the ground truth `tests/test_controller_live.py` cites.

    serve run configs/app.yaml &
    python -m bench.speculation_by_load --out bench/results/load-cpu

Each cell drives `streams` closed-loop clients (greedy, ignore_eos, one prompt) under one
policy and measures, from the replica's step records, decode tokens per second of step time:
(sequences decoded + draft tokens accepted) / step seconds, over steps without prefill.
Rounds run the policies in alternating order, so drift of a noisy machine spreads over all.
Writes results.json (with the machine's load and busy processes at start and end), a
markdown table and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from adaspec.telemetry import StepRecord, decode_tokens_per_s, tokens_per_sequence_step  # noqa: E402
from bench import machine  # noqa: E402
from bench.replica_probe import ReplicaProbe  # noqa: E402
from serve_app.admin_client import controller_action, set_policy  # noqa: E402

PROMPT = "Write a short story about a cat who learns to fly."  # the live controller test's


async def _steps_during(url: str, seconds: float) -> list[StepRecord]:
    """Every replica step that ended in the next `seconds`."""
    async with ReplicaProbe(url, period_s=1.0) as probe:
        await asyncio.sleep(seconds)
    return [s for steps in probe.steps.values() for s in steps.values()]


def measure(url: str, model: str, streams: int, seconds: float, max_tokens: int,
            prompt: str = PROMPT) -> tuple[float, list[StepRecord]]:
    """Run `streams` clients for a warm-up of 6 s and then `seconds`; the cell's tokens/s and steps."""
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(6)  # a warm-up: the batch fills and the previous policy's steps end
    steps = asyncio.run(_steps_during(url, seconds))
    stop.set()
    for t in threads:
        t.join()
    return decode_tokens_per_s(steps), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model id to request")
    ap.add_argument("--policies", default="off,chain1,chain2,chain4", help="comma-separated policies")
    ap.add_argument("--streams", default="1,24", help="comma-separated numbers of concurrent clients")
    ap.add_argument("--rounds", type=int, default=2, help="repetitions, policy order alternating")
    ap.add_argument("--seconds", type=float, default=20, help="measured seconds per cell (after 6 s warm-up)")
    ap.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    ap.add_argument("--prompt", default=PROMPT, help="the prompt every request sends")
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json, report.md, plot")
    args = ap.parse_args()
    policies, streams = args.policies.split(","), [int(n) for n in args.streams.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    controller_action(args.url, "pause")
    machine_at_start = machine.describe()
    cells = []
    for r in range(args.rounds):
        for n in streams:
            for policy in policies if r % 2 == 0 else policies[::-1]:
                set_policy(args.url, policy)
                tps, steps = measure(args.url, args.model, n, args.seconds, args.max_tokens, args.prompt)
                batch = statistics.median(s.batch_size for s in steps)
                per_step = tokens_per_sequence_step([s for s in steps if not s.prefill_tokens])
                cells.append({"round": r, "streams": n, "policy": policy, "tokens_per_s": tps,
                              "tokens_per_sequence_step": per_step, "steps": len(steps), "median_batch": batch})
                print(f"round {r + 1}/{args.rounds}, {n} streams, {policy}: {tps:.1f} tok/s, {per_step:.2f} "
                      f"tokens a sequence-step ({len(steps)} steps, median batch {batch:g})", flush=True)
    (args.out / "results.json").write_text(json.dumps({
        "prompt": args.prompt, "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {**machine_at_start, **machine.at_end(machine_at_start)}, "cells": cells}, indent=1))
    lines = ["| streams | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    fig, axes = plt.subplots(1, len(streams), figsize=(4 * len(streams), 3.2))
    for ax, n in zip(axes if len(streams) > 1 else [axes], streams):
        per = {p: [c["tokens_per_s"] for c in cells if c["streams"] == n and c["policy"] == p] for p in policies}
        best = max(statistics.mean(v) for v in per.values())
        lines.append(f"| {n} | " + " | ".join(
            f"{'/'.join(f'{x:.1f}' for x in v)} ({statistics.mean(v) / best:.2f}x)" for v in per.values()) + " |")
        ax.bar(policies, [statistics.mean(v) for v in per.values()],
               yerr=[[statistics.mean(v) - min(v) for v in per.values()],
                     [max(v) - statistics.mean(v) for v in per.values()]])
        ax.set_title(f"{n} stream(s)")
        ax.set_ylabel("decode tokens/s")
    fig.tight_layout()
    fig.savefig(args.out / "tokens_per_s.png", dpi=120)
    table = "\n".join(lines)
    (args.out / "report.md").write_text(
        "Decode tokens/s per round (mean as a multiple of the best policy at that load)\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
