"""Speculation-aware routing: which replica finishes a new request soonest (pure math, no Ray).

Each replica reports a `RoutingStats` (adaspec/telemetry.py): its running batch, its queue,
its measured step time at the batch it ran, and the output tokens a sequence gains per step
(1 + mean accepted draft tokens). A replica that speculates well gains more tokens per step,
so at equal load it finishes sooner and drains its queue faster. serve_app/router.py asks
`rank_replicas` for every request; docs/routing.md gives the model with an example.

The model of a new request of `output_tokens` tokens on a replica (all times in seconds):

    n      = running + waiting + sent + 1      the requests there once it arrives (sent: what
                                               the router sent after the stats were measured)
    b      = min(n, max_batch)                 the batch it decodes in
    t(b)   = step_s * (f + (1 - f) * b / step_batch)
                                               step time, scaled from the batch it was measured
                                               at: a share f of a step does not grow with the
                                               batch (weights read once, launch overheads)
    decode = output_tokens * t(b) / tokens_per_step
    queue  = 0                                 if n <= max_batch, else, for the n - max_batch
             (n - max_batch) * L * t(max_batch) / (max_batch * tokens_per_step)
                                               requests that wait for a slot, the time the full
                                               batch takes to free that many slots: a slot frees
                                               every L * t / tokens_per_step / max_batch seconds
                                               (L: mean output tokens of recent requests),
                                               less the time since the stats were measured
    predicted = queue + decode

Prefill is not modelled (prompts are short next to a decode on these engines).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from adaspec.telemetry import RoutingStats

ReplicaId = TypeVar("ReplicaId", bound=Hashable)

# Share of a step's time that does not grow with the batch. Decoding is memory-bound at
# small batches (the weights are read once per step whatever the batch), so step time grows
# slower than the batch; 0.5 is a middle value between flat (1.0) and proportional (0.0).
FIXED_STEP_SHARE = 0.5
# Predictions within this fraction of the best are ties, broken at random so that equal
# replicas share the load between two stats updates instead of one taking everything.
TIE_TOLERANCE = 0.05
# Output tokens assumed for a request that does not say (its max_tokens unset).
DEFAULT_OUTPUT_TOKENS = 128


def step_time_s(stats: RoutingStats, batch: float, fixed_share: float = FIXED_STEP_SHARE) -> float:
    """Seconds per step at `batch` requests, scaled from the step time the replica measured
    at its recent mean batch. Needs measured stats (step_s and step_batch set)."""
    assert stats.step_s is not None and stats.step_batch is not None, "unmeasured stats"
    return stats.step_s * (fixed_share + (1.0 - fixed_share) * max(batch, 1.0) / stats.step_batch)


def predicted_completion_s(stats: RoutingStats, output_tokens: int, now: float, *, sent: int = 0,
                           fixed_share: float = FIXED_STEP_SHARE) -> float:
    """Predicted seconds until a new request of `output_tokens` tokens, sent now (unix s),
    finishes on the replica (the module docstring's model). `sent`: requests the router sent
    there after `stats.measured_at`, which the stats do not count yet."""
    max_batch = stats.max_batch_size
    output_tokens = max(output_tokens, 1)
    n = stats.running + stats.waiting + sent + 1
    tokens_per_step = stats.tokens_per_step
    decode = output_tokens * step_time_s(stats, min(n, max_batch), fixed_share) / tokens_per_step
    queue = 0.0
    if n > max_batch:
        mean_output = stats.mean_output_tokens or output_tokens
        slot_s = mean_output * step_time_s(stats, max_batch, fixed_share) / tokens_per_step / max_batch
        # The queue kept draining since the stats were measured.
        queue = max((n - max_batch) * slot_s - max(now - stats.measured_at, 0.0), 0.0)
    return queue + decode


def _fill_unmeasured(stats: list[RoutingStats], fixed_share: float) -> list[RoutingStats] | None:
    """Stats with a step time for every replica: one that has not decoded yet (just started)
    gets the fleet's median step time at batch 1 and median tokens per step, as the replicas
    of one deployment run the same model on the same kind of hardware. None when no replica
    has measured one."""
    measured = [s for s in stats if s.step_s is not None and s.step_batch is not None]
    if not measured:
        return None
    if len(measured) == len(stats):
        return stats
    step_at_1 = statistics.median(step_time_s(s, 1.0, fixed_share) for s in measured)
    tokens = statistics.median(s.tokens_per_step for s in measured)
    return [s if s.step_s is not None and s.step_batch is not None
            else s.model_copy(update={"step_s": step_at_1, "step_batch": 1.0, "tokens_per_step": tokens})
            for s in stats]


def rank_replicas(candidates: Sequence[tuple[ReplicaId, RoutingStats | None]], now: float, max_stats_age_s: float,
                  *, output_tokens: int = DEFAULT_OUTPUT_TOKENS, sent: Mapping[ReplicaId, int] | None = None,
                  fixed_share: float = FIXED_STEP_SHARE, tie_tolerance: float = TIE_TOLERANCE,
                  rng: random.Random | None = None) -> list[ReplicaId] | None:
    """The candidates best first by predicted completion time of a request of `output_tokens`,
    or None when any candidate's stats are missing or older than `max_stats_age_s` (seconds
    before `now`, unix s), or none has measured a step yet: then the caller routes without
    them. The replicas within `tie_tolerance` of the best come first in random order."""
    if not candidates:
        return None
    stats = [s for _, s in candidates]
    if any(s is None or now - s.measured_at > max_stats_age_s for s in stats):
        return None
    filled = _fill_unmeasured(stats, fixed_share)  # type: ignore[arg-type]  # no None left
    if filled is None:
        return None
    sent = sent or {}
    scored = sorted(
        (predicted_completion_s(s, output_tokens, now, sent=sent.get(rid, 0), fixed_share=fixed_share), i)
        for i, ((rid, _), s) in enumerate(zip(candidates, filled)))
    best = scored[0][0]
    ties = [i for pred, i in scored if pred <= best * (1.0 + tie_tolerance)]
    (rng or random).shuffle(ties)
    rest = [i for pred, i in scored if pred > best * (1.0 + tie_tolerance)]
    return [candidates[i][0] for i in ties + rest]


def choose_replica(candidates: Sequence[tuple[ReplicaId, RoutingStats | None]], now: float, max_stats_age_s: float,
                   *, output_tokens: int = DEFAULT_OUTPUT_TOKENS, sent: Mapping[ReplicaId, int] | None = None,
                   fixed_share: float = FIXED_STEP_SHARE, tie_tolerance: float = TIE_TOLERANCE,
                   rng: random.Random | None = None) -> ReplicaId | None:
    """The candidate that finishes the request soonest (`rank_replicas`' first), or None
    when the stats cannot tell (missing, stale, none measured): the caller falls back."""
    ranked = rank_replicas(candidates, now, max_stats_age_s, output_tokens=output_tokens, sent=sent,
                           fixed_share=fixed_share, tie_tolerance=tie_tolerance, rng=rng)
    return ranked[0] if ranked else None
