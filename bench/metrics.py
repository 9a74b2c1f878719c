"""Serving metrics from client-side request timings, defined as vLLM's `bench serve` does.

- TTFT: send -> first token.  TPOT (per request): (E2E - TTFT) / (output tokens - 1).
- ITL: gaps between streamed chunks after the first (a chunk may carry several tokens when
  speculation accepts drafts, so ITL and TPOT differ under speculation).
- E2E: send -> last token.  Throughputs over the run: first send -> last completion.
- Goodput (Zhong et al., DistServe): completed requests per second whose TTFT and TPOT both
  meet their SLOs.
Percentiles interpolate linearly (numpy's default, vLLM's too).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from bench.client import RequestResult


class Stat(BaseModel):
    """Mean and percentiles of one metric, in seconds."""

    mean: float | None = None
    p50: float | None = None
    p99: float | None = None


def stat(values: list[float]) -> Stat:
    if not values:
        return Stat()
    a = np.asarray(values, dtype=float)
    return Stat(mean=float(a.mean()), p50=float(np.percentile(a, 50)), p99=float(np.percentile(a, 99)))


def tpot_s(r: RequestResult) -> float | None:
    """Seconds per output token after the first; None with fewer than two tokens."""
    if r.ttft_s is None or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


class BenchMetrics(BaseModel):
    completed: int
    errors: int
    duration_s: float = Field(description="first send -> last completion")
    request_throughput: float = Field(description="completed requests per second")
    output_throughput: float = Field(description="output tokens per second")
    total_output_tokens: int
    total_prompt_tokens: int
    ttft_s: Stat
    tpot_s: Stat
    itl_s: Stat
    e2e_s: Stat
    slo_ttft_s: float
    slo_tpot_s: float
    goodput: float = Field(description="requests per second meeting both SLOs")


def summarize(results: list[RequestResult], slo_ttft_s: float, slo_tpot_s: float) -> BenchMetrics:
    ok = [r for r in results if r.ok]
    if results:
        first = min(r.sent_at for r in results)
        last = max(r.sent_at + r.e2e_s for r in results)
        duration = max(last - first, 1e-9)
    else:
        duration = 1e-9
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    good = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
               and (tpot_s(r) or 0.0) <= slo_tpot_s)
    out_tokens = sum(r.output_tokens for r in ok)
    return BenchMetrics(
        completed=len(ok), errors=len(results) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
        total_output_tokens=out_tokens, total_prompt_tokens=sum(r.prompt_tokens for r in ok),
        ttft_s=stat([r.ttft_s for r in ok if r.ttft_s is not None]), tpot_s=stat(tpots),
        itl_s=stat([g for r in ok for g in r.itl_s]), e2e_s=stat([r.e2e_s for r in ok]),
        slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s, goodput=good / duration)
