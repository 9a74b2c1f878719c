"""`adaspec profile`: a step-time profiling sweep against a live adaspec server.

For every speculation length k and batch size B of the grid, the sweep pushes the policy
`chainK` to every replica (the controller is paused meanwhile), runs B concurrent greedy
requests, and collects the engine steps they caused from the replicas' telemetry. It saves
the steps (JSON lines `{"model_id", "step"}`, the format `controller.profile_path` reads),
fits the step-time model, and reports its error on held-out steps.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from adaspec.policy import SpecConfig
from adaspec.telemetry import ProfiledStep
from controller.step_time import StepTimeModel
from serve_app import admin_client

PROMPTS = [
    "Write a short story about a cat who learns to fly.",
    "Explain how a transformer language model generates text.",
    "def quicksort(arr):\n    \"\"\"Sort a list using quicksort.\"\"\"\n",
    "List ten countries in Europe and their capitals:",
    "one two three four five six, one two three four five six, one two",
    "The history of the Roman Empire began",
]


def _run_batch(url: str, model: str, batch: int, max_tokens: int) -> None:
    errors: list[str] = []

    def one(i: int) -> None:
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        if r.status_code != 200:
            errors.append(r.text[:200])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise admin_client.AdminError(f"profiling requests failed: {errors[0]}")


def profile(url: str, out: Path, ks: list[int], batches: list[int], max_tokens: int = 64,
            token: str | None = None, log=print) -> dict:
    """Run the sweep; write out/steps.jsonl and out/profile.json; return the summary."""
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
    model = StepTimeModel()
    try:
        with steps_file.open("w") as f:
            for i, (k, batch) in enumerate([(k, b) for k in ks for b in batches]):
                admin_client.set_policy(url, str(SpecConfig.chain(k)), token)
                start = time.time()
                _run_batch(url, model_id, batch, max_tokens)
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
               "cells": cells, "fit": {"kind": fit.kind, "samples": fit.samples,
                                       "holdout_samples": fit.holdout_samples, "holdout_mape": fit.holdout_mape},
               "steps_file": str(steps_file)}
    (out / "profile.json").write_text(json.dumps(summary, indent=2))
    log(f"step-time model: {fit.kind} on {fit.samples} steps; held-out error (MAPE) "
        f"{100 * fit.holdout_mape:.1f}% on {fit.holdout_samples} steps")
    return summary

