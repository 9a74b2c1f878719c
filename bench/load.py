"""An open-loop load generator for OpenAI-compatible servers: Poisson arrivals (gamma with
burstiness), one coroutine per request, per-request latency and output tokens."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx


@dataclass
class RequestResult:
    sent_at: float  # seconds since the run started
    latency_s: float
    output_tokens: int
    ok: bool
    error: str = ""


def arrival_times(rate: float, n: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """Offsets (seconds) of n arrivals: gamma inter-arrival times with mean 1/rate and shape
    `burstiness` (1 = Poisson); rate inf sends everything at once."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


async def _one(client: httpx.AsyncClient, url: str, body: dict, start: float, offset: float) -> RequestResult:
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    sent = time.perf_counter()
    try:
        r = await client.post(f"{url}/v1/completions", json=body)
        latency = time.perf_counter() - sent
        if r.status_code != 200:
            return RequestResult(sent - start, latency, 0, False, f"{r.status_code} {r.text[:200]}")
        return RequestResult(sent - start, latency, r.json()["usage"]["completion_tokens"], True)
    except httpx.HTTPError as e:
        return RequestResult(sent - start, time.perf_counter() - sent, 0, False, repr(e))


async def run_load(url: str, model: str, prompts: list[str], rate: float, num_requests: int,
                   max_tokens: int, seed: int = 0, burstiness: float = 1.0,
                   ignore_eos: bool = True) -> list[RequestResult]:
    """Send num_requests completions at `rate` requests/s; return one result per request."""
    offsets = arrival_times(rate, num_requests, seed, burstiness)
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=1000)) as client:
        start = time.perf_counter()
        tasks = [
            _one(client, url, {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": ignore_eos}, start, off)
            for i, off in enumerate(offsets)]
        return await asyncio.gather(*tasks)
