"""Does `adaspec simulate` predict real latency? One replica, three request rates.

Against a live adaspec server (controller paused, a fixed policy): Poisson load at each
rate, mean request latency measured; the replica's own steps from those runs fit the
simulator's step-time and acceptance models; the simulator then runs the same rates, and
the ratio simulated / measured mean latency is printed per rate (goal: within 15%).

    serve run configs/app.yaml &
    PYTHONPATH=. python experiments/simulator_accuracy.py --rates 0.5,1,2 --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from adaspec.datasets import Prompt
from adaspec.telemetry import EngineCapabilities, ProfiledStep, read_profile
from bench.client import arrival_times, run_load
from serve_app import admin_client
from controller.acceptance import measured_acceptance, measured_proposal_rate
from controller.simulate import SimulatedEngine, simulate
from controller.step_time import StepTimeModel, measured_context_per_seq

PROMPT = "Write a short story about a cat who learns to fly."


def measure(args) -> tuple[str, EngineCapabilities, dict[float, float], list]:
    reports = admin_client.status(args.url)
    model_id, caps = reports[0].model_id, reports[0].info.capabilities
    view = admin_client.controller_view(args.url)
    if view and not view.paused:
        admin_client.controller_action(args.url, "pause")
    admin_client.set_policy(args.url, args.policy)
    measured, steps = {}, []
    try:
        for rate in [float(r) for r in args.rates.split(",")]:
            start = time.time()
            prompts = [Prompt("cat", "custom", PROMPT, False, "")] * args.requests
            results = asyncio.run(run_load(args.url, model_id, prompts, arrival_times(rate, args.requests, seed=1),
                                           args.max_tokens, progress=False))
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
            measured[rate] = statistics.fmean(r.e2e_s for r in results)
            steps += [s for r in admin_client.status(args.url) for s in r.steps if s.time > start]
            print(f"rate {rate}: measured mean latency {measured[rate]:.3f} s over {len(results)} requests", flush=True)
    finally:
        if view and not view.paused:
            admin_client.controller_action(args.url, "resume")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "measured.json").write_text(json.dumps({
            "capabilities": caps.model_dump(), "measured": measured, "policy": args.policy,
            "max_tokens": args.max_tokens, "requests": args.requests}, indent=2))
        with (out / "steps.jsonl").open("w") as f:
            for s in steps:
                f.write(ProfiledStep(model_id=model_id, step=s).model_dump_json() + "\n")
    return model_id, caps, measured, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rates", default="0.5,1,2")
    parser.add_argument("--requests", type=int, default=40, help="requests per rate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--policy", default="chain2")
    parser.add_argument("--out", help="save the measurements here (measured.json, steps.jsonl)")
    parser.add_argument("--replay", help="re-simulate measurements saved with --out (no server)")
    args = parser.parse_args()

    if args.replay:
        saved = json.loads((Path(args.replay) / "measured.json").read_text())
        model_id, steps = read_profile(str(Path(args.replay) / "steps.jsonl"))
        caps = EngineCapabilities.model_validate(saved["capabilities"])
        measured = {float(r): v for r, v in saved["measured"].items()}
        args.policy, args.max_tokens = saved["policy"], saved["max_tokens"]
    else:
        model_id, caps, measured, steps = measure(args)
    model = StepTimeModel()
    model.add(steps)
    fit = model.fit()
    rates = measured_acceptance(steps, caps.max_k)
    prefills = [s.prefill_tokens for s in steps if s.prefill_tokens]
    prompt_tokens = int(statistics.median(prefills)) if prefills else 16
    context = measured_context_per_seq(steps) or 0.0
    engine = SimulatedEngine.from_models(model, rates, caps.max_batch_size, caps.max_k, context, model_id,
                                         measured_proposal_rate(steps))
    rows = []
    for rate, real in measured.items():
        sim = simulate(engine, 1, duration_s=max(600.0, 200 / rate), rate=rate, policy=args.policy,
                       output_tokens=args.max_tokens, prompt_tokens=prompt_tokens, warmup_s=20)
        rows.append({"rate": rate, "measured_s": real, "simulated_s": sim.mean_latency_s,
                     "ratio": sim.mean_latency_s / real})
    print(f"step-time model: {fit.kind}, held-out error {100 * (fit.holdout_mape or 0):.1f}% on {fit.samples} steps; "
          f"acceptance per position {[round(r, 2) for r in rates]}, proposal rate {engine.proposal_rate:.2f}")
    print("| rate (req/s) | measured mean latency (s) | simulated (s) | simulated / measured |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']} | {r['measured_s']:.3f} | {r['simulated_s']:.3f} | {r['ratio']:.3f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
