"""`adaspec bench`: one load run against an OpenAI-compatible endpoint, its JSON and summary.

    adaspec bench --url http://127.0.0.1:8000 --dataset sharegpt --rate 1 --num-prompts 40

A run = the dataset's test-split prompts (seeded: same seed, same prompts, same arrival
times), sent open-loop (bench/client.py), measured on the client (bench/metrics.py) and,
where the target is adaspec, on the replicas (bench/replica_probe.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import httpx
from pydantic import BaseModel, Field, model_validator

from bench.client import RequestMix, RequestResult, arrival_times, run_load
from adaspec.datasets import Prompt
from adaspec.models import ModelError
from prepare.datasets import load_prompts
from prepare.models import resolve_model
from bench.metrics import BenchMetrics, summarize
from bench.replica_probe import ReplicaProbe, TelemetryTrace
from serve_app.admin_client import QUIET_LOGGERS


class BenchError(RuntimeError):
    """The target cannot be benchmarked; the message names the flag."""


class BenchSettings(BaseModel):
    url: str
    dataset: str
    rate: float = Field(description="requests per second; inf = all at once")
    num_prompts: int
    burstiness: float = 1.0
    max_tokens: int = Field(default=128, description="cap on output tokens per request; with ignore_eos, "
                                                     "every request's exact length")
    request_mix: RequestMix = Field(default_factory=RequestMix, description="how requests decode and stop")
    seed: int = 0
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    label: str = Field(default="", description="what ran (a policy name in a sweep)")

    @model_validator(mode="before")
    @classmethod
    def _results_before_realistic_requests(cls, data):
        # Results written before `request_mix` existed ran every request greedy with ignore_eos.
        if isinstance(data, dict) and "request_mix" not in data and "label" in data:
            data = {**data, "request_mix": RequestMix.synthetic()}
        return data


class BenchResult(BaseModel):
    settings: BenchSettings
    model: str
    started_at: float = Field(description="unix seconds")
    metrics: BenchMetrics
    telemetry: TelemetryTrace
    requests: list[dict] = Field(default_factory=list, description="per request RequestResult")


def served_model(url: str) -> str:
    """The first model the endpoint serves (GET /v1/models)."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise BenchError(f"--url: no OpenAI-compatible server answers GET {url}/v1/models ({e})") from None


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str):
    """The embedded model's tokenizer when `model` names one here, else None; loaded once
    per process (a sweep asks for it in every cell)."""
    try:
        folder = Path(resolve_model(model, prepare=False))
        if folder.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(folder)
    except (ModelError, OSError, ValueError):  # a model this machine does not have
        pass
    logging.getLogger(__name__).info("no tokenizer for %s here: reply lengths estimated at 4 chars/token", model)
    return None


def reply_token_caps(prompts: list[Prompt], model: str, cap: int) -> list[int]:
    """Per prompt: its dataset's recorded reply (ShareGPT's answer, HumanEval's solution, the
    code edit's function) in the served model's tokens, at most `cap` and at least 1. The
    tokenizer is the embedded model's when `model` names one; otherwise 4 characters make a
    token (an estimate)."""
    tokenizer = _tokenizer(model)
    out = []
    for p in prompts:
        n = len(tokenizer.encode(p.reference_output)) if tokenizer else len(p.reference_output) // 4
        out.append(max(1, min(cap, n)))
    return out


async def bench_prompts(settings: BenchSettings, prompts: list[Prompt], offsets: list[float], model: str,
                        progress: bool = True, token: str | None = None) -> BenchResult:
    """Run `prompts` at `offsets` (seconds) with the replica probe on: decoding as
    settings.samplings says, each asking for at most its reply length (or exactly max_tokens
    when synthetic)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    mix = settings.request_mix
    caps = settings.max_tokens if mix.ignore_eos else reply_token_caps(prompts, model, settings.max_tokens)
    started = time.time()
    async with ReplicaProbe(settings.url, token) as probe:
        results: list[RequestResult] = await run_load(settings.url, model, prompts, offsets, caps,
                                                      progress=progress, sampling=mix.samplings(len(prompts), settings.seed))
    return BenchResult(settings=settings, model=model, started_at=started,
                       metrics=summarize(results, settings.slo_ttft_s, settings.slo_tpot_s),
                       telemetry=probe.trace(), requests=[asdict(r) for r in results])


def run_bench(settings: BenchSettings, progress: bool = True, token: str | None = None,
              model: str | None = None) -> BenchResult:
    prompts = load_prompts(settings.dataset, settings.num_prompts, settings.seed, split="test")
    offsets = arrival_times(settings.rate, len(prompts), settings.seed, settings.burstiness)
    model = model or served_model(settings.url)
    return asyncio.run(bench_prompts(settings, prompts, offsets, model, progress, token))


def result_path(out: Path, settings: BenchSettings) -> Path:
    label = f"-{settings.label}" if settings.label else ""
    return out / f"bench-{settings.dataset}-rate{settings.rate:g}{label}.json".replace(":", "_")


def save(result: BenchResult, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = result_path(out, result.settings)
    path.write_text(json.dumps(result.model_dump(mode="json"), indent=1))
    return path


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:8.1f}"


def format_summary(result: BenchResult) -> str:
    """The one-screen summary, laid out like vLLM's."""
    s, m, t = result.settings, result.metrics, result.telemetry
    lines = [
        f"==== adaspec bench: {s.dataset}, rate {s.rate:g} req/s (burstiness {s.burstiness:g}), "
        f"{s.num_prompts} prompts, model {result.model} ====",
        f"requests: {s.request_mix.describe(s.max_tokens)}",
        f"completed {m.completed}, errors {m.errors}, duration {m.duration_s:.1f} s",
        f"request throughput {m.request_throughput:.3f} req/s, output {m.output_throughput:.1f} tokens/s, "
        f"goodput {m.goodput:.3f} req/s (TTFT <= {m.slo_ttft_s:g} s, TPOT <= {1000 * m.slo_tpot_s:g} ms)",
        f"{'(ms)':<6}{'mean':>9}{'p50':>9}{'p99':>9}",
    ]
    for name, st in (("TTFT", m.ttft_s), ("TPOT", m.tpot_s), ("ITL", m.itl_s), ("E2E", m.e2e_s)):
        lines.append(f"{name:<6}{_ms(st.mean)}{_ms(st.p50)}{_ms(st.p99)}")
    if t.available:
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        lines.append(f"replicas: {t.steps} steps, mean accepted length {fmt(t.mean_accepted_length, '.2f')}, "
                     f"acceptance rate {fmt(t.acceptance_rate, '.3f')}, mean k {fmt(t.mean_k, '.2f')}, "
                     f"{len(t.policy_changes)} policy changes; policies: {' -> '.join(t.policies_seen) or '-'}")
    else:
        lines.append(f"replicas: no adaspec telemetry ({t.error})")
    return "\n".join(lines)
