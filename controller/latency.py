"""Latency model under load (Kong et al., "An Interpretable Latency Model for Speculative
Decoding in LLM Serving"; docs/papers.md section 4).

Per-request latency grows with the number of requests served together: L(B) = C1 + B * C2
(C1: an empty server's latency, seconds; C2: seconds added per concurrent request). Little's
law ties the batch to the load, B = rate * L, so L = C1 / (1 - rate * C2) and the server
saturates as rate -> 1 / C2 (requests/s). The batch is therefore not an input: it results
from the policy. `operating_point` solves B = rate * L(B, policy) for any latency curve, so
a controller picks the policy for the batch its own choice will cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from adaspec.policy import SpecConfig
from adaspec.telemetry import RequestRecord


@dataclass(frozen=True)
class LatencyCoefficients:
    c1_s: float  # latency of a lone request (seconds)
    c2_s: float  # latency added per concurrent request (seconds)

    @property
    def saturation_rate(self) -> float:
        """Requests/s at which latency diverges."""
        return math.inf if self.c2_s <= 0 else 1.0 / self.c2_s

    def mean_latency(self, rate: float) -> float:
        """L = C1 / (1 - rate * C2) (seconds); inf at or beyond saturation."""
        load = rate * self.c2_s
        return math.inf if load >= 1 else self.c1_s / (1 - load)

    def batch(self, rate: float) -> float:
        """Little's law: mean concurrent requests B = rate * L."""
        return rate * self.mean_latency(rate)


def fit_latency_coefficients(batch: np.ndarray, latency: np.ndarray) -> LatencyCoefficients:
    """Least-squares fit of L = C1 + B * C2 with C1, C2 >= 0."""
    from scipy.optimize import nnls

    batch, latency = np.asarray(batch, float), np.asarray(latency, float)
    coef, _ = nnls(np.column_stack([np.ones_like(batch), batch]), latency)
    return LatencyCoefficients(float(coef[0]), float(coef[1]))


def request_latency(step_time_s: float, expected_length: float, output_tokens: float) -> float:
    """Seconds a request of `output_tokens` spends decoding at a given step time: one step
    for its prompt, then output_tokens / E verify steps."""
    return step_time_s * (1.0 + output_tokens / expected_length)


@dataclass(frozen=True)
class OperatingPoint:
    batch: float  # mean concurrent requests
    latency_s: float  # mean request latency (seconds)
    saturated: bool  # no fixed point below the engine's largest batch


def operating_point(rate: float, latency_at: Callable[[float], float], max_batch: float,
                    iterations: int = 24) -> OperatingPoint:
    """Solve B = rate * L(B) by bisection (L non-decreasing in B), B in (0, max_batch]."""
    if rate <= 0:
        return OperatingPoint(0.0, latency_at(1.0), False)
    if rate * latency_at(max_batch) > max_batch:
        return OperatingPoint(max_batch, math.inf, True)
    lo, hi = 0.0, max_batch
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if rate * latency_at(max(mid, 1.0)) > mid:
            lo = mid
        else:
            hi = mid
    return OperatingPoint(hi, latency_at(max(hi, 1.0)), False)


def break_even_rate(base: LatencyCoefficients, spec: LatencyCoefficients) -> float:
    """Requests/s beyond which speculation is slower than none (Kong et al.):
    RPS* = (1 - C1r) / (C2_sd - C1r * C2_base), C1r = C1_sd / C1_base; inf if it never is.
    A base fit without a fixed part (C1_base = 0, a fit of requests that all ran in large
    batches) is beaten from the start by any speculation that has one, or that adds more per
    concurrent request."""
    if base.c1_s <= 0:
        return 0.0 if spec.c1_s > 0 or spec.c2_s >= base.c2_s else math.inf
    c1r = spec.c1_s / base.c1_s
    denominator = spec.c2_s - c1r * base.c2_s
    if c1r >= 1:
        return 0.0
    return math.inf if denominator <= 0 else (1 - c1r) / denominator


MIN_FIT_REQUESTS = 8  # finished requests of one config before its latency is fitted


class LatencyFit(BaseModel):
    """Kong et al.'s L = C1 + B * C2, fitted on one config's measured requests.

    Fitted per output token (L / output tokens), so that requests of different lengths
    share one fit; `coefficients(n)` scales it to requests of n output tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: SpecConfig
    samples: int  # requests fitted
    batch_lo: float  # smallest and largest mean batch among them (requests)
    batch_hi: float
    c1_per_token_s: float  # seconds per output token of a lone request
    c2_per_token_s: float  # seconds per output token added by each concurrent request
    relative_error: float  # mean |fit - measured| / measured over the samples

    def coefficients(self, output_tokens: float) -> LatencyCoefficients:
        return LatencyCoefficients(self.c1_per_token_s * output_tokens, self.c2_per_token_s * output_tokens)


def fit_request_latency(config: SpecConfig, records: Sequence[RequestRecord]) -> LatencyFit | None:
    """The fit over finished requests of `config`; None below MIN_FIT_REQUESTS.

    With every request at one batch size C1 and C2 cannot be told apart; the fit then
    puts it all in C1 (nnls), and batch_lo == batch_hi tells the reader so."""
    rows = [r for r in records if r.output_tokens > 0]
    if len(rows) < MIN_FIT_REQUESTS:
        return None
    batch = np.array([r.mean_batch for r in rows])
    per_token = np.array([r.latency_s / r.output_tokens for r in rows])
    if np.ptp(batch) < 0.5:
        coef = LatencyCoefficients(float(per_token.mean()), 0.0)
    else:
        coef = fit_latency_coefficients(batch, per_token)
    predicted = coef.c1_s + batch * coef.c2_s
    error = float(np.mean(np.abs(predicted - per_token) / np.maximum(per_token, 1e-9)))
    return LatencyFit(config=config, samples=len(rows), batch_lo=float(batch.min()), batch_hi=float(batch.max()),
                      c1_per_token_s=coef.c1_s, c2_per_token_s=coef.c2_s, relative_error=error)
