"""Speculation-aware routing: where a new request costs least (pure math, no Ray).

Each replica reports a `RoutingStats` (adaspec/telemetry.py): its running batch, its queue,
its measured step time at the batch it ran, the output tokens a sequence gains per step
(1 + mean accepted draft tokens) and, when a controller runs, the controller's predicted
time per output token at every batch size under the policy in force (`speed`: the
deployment's step-time model and the replica's acceptance model). A replica that speculates
well gains more tokens per step, so at equal load it finishes sooner and drains its queue
faster. serve_app/router.py asks `rank_replicas` for every request; docs/routing.md gives the
model with an example.

The model of a new request of `output_tokens` tokens on a replica (all times in seconds):

    n      = max(running + waiting + change, 0) + 1
                                               the requests there once it arrives (change: the
                                               requests the router sent there after the stats
                                               measured the load, less those it saw finish there
                                               since, so negative when more finished)
    b      = min(n, max_batch)                 the batch it decodes in
    tpot(b)                                    seconds per output token of a sequence at batch b:
      with the controller's speed:   speed(b) * measured / speed(step_batch)
                                               the models' curve across batch sizes (the policy
                                               may speculate less at larger batches), scaled to
                                               what the replica measures now (the level of this
                                               machine, this minute), the scale kept in [1/4, 4]
      without: step_s * (f + (1 - f) * b / step_batch) / tokens_per_step
                                               the measured step time scaled from the batch it
                                               was measured at: a share f of a step does not
                                               grow with the batch (weights read once, launch
                                               overheads)
      (measured = step_s / tokens_per_step, at step_batch)
    decode = output_tokens * tpot(b)
    queue  = 0                                 if n <= max_batch, else, for the n - max_batch
             (n - max_batch) * L * tpot(max_batch) / max_batch
                                               requests that wait for a slot, the time the full
                                               batch takes to free that many slots: a slot frees
                                               every L * tpot / max_batch seconds (L: mean output
                                               tokens of recent requests), less the time since
                                               the stats were measured beyond one slot per
                                               finish the router saw (those are off n already)
    predicted = queue + decode
    added  = m * (L / 2) * (tpot(m + 1) - tpot(m)),  m = n - 1 < max_batch (else 0)
                                               the time the request adds to the m requests
                                               already decoding there (each about half done):
                                               one more sequence slows every step; in a full
                                               batch it waits for a slot and slows no one
    cost   = predicted + added                 what the router minimises

Without `added` the router is selfish: it sends each request where that request alone
finishes first, piling requests onto the replica that speculates well until its batch grows
and every request there slows (simulated: 4-10% worse mean latency than power of two at
3 req/s over 3 replicas; docs/routing.md).

With many replicas the router scores a random sample of `max_candidates` of them (the
power-of-d choices idea): a few microseconds per replica scored, whatever the fleet's size.

Prefill is not modelled (prompts are short next to a decode on these engines).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

from adaspec.telemetry import RoutingStats

ReplicaId = TypeVar("ReplicaId", bound=Hashable)
T = TypeVar("T")

# Share of a step's time that does not grow with the batch. Decoding is memory-bound at
# small batches (the weights are read once per step whatever the batch), so step time grows
# slower than the batch; 0.5 is a middle value between flat (1.0) and proportional (0.0).
FIXED_STEP_SHARE = 0.5
# Predictions within this fraction of the best are ties, broken at random so that equal
# replicas share the load between two stats updates instead of one taking everything.
TIE_TOLERANCE = 0.05
# Output tokens assumed for a request that does not say (its max_tokens unset).
DEFAULT_OUTPUT_TOKENS = 128
# The most replicas scored per request; more are sampled down to this many at random.
MAX_CANDIDATES = 16
# The controller's speed curve is scaled to the replica's measurement by at most this factor
# either way: beyond it the measurement is more likely a transient (a prefill burst) than the
# models being that wrong.
CALIBRATION_LIMIT = 4.0


def step_time_s(stats: RoutingStats, batch: float, fixed_share: float = FIXED_STEP_SHARE) -> float:
    """Seconds per step at `batch` requests, scaled from the step time the replica measured
    at its recent mean batch. Needs measured stats (step_s and step_batch set)."""
    assert stats.step_s is not None and stats.step_batch is not None, "unmeasured stats"
    return stats.step_s * (fixed_share + (1.0 - fixed_share) * max(batch, 1.0) / stats.step_batch)


def tpot_s(stats: RoutingStats, batch: float, fixed_share: float = FIXED_STEP_SHARE) -> float:
    """Seconds per output token of one sequence at `batch` requests on the replica (the
    module docstring's tpot(b)). Needs measured stats or the controller's speed."""
    return tpot_curve(stats, fixed_share)(batch)


def tpot_curve(stats: RoutingStats, fixed_share: float = FIXED_STEP_SHARE) -> Callable[[float], float]:
    """`tpot_s` of the replica as a function of the batch, its calibration to the replica's
    measurement worked out once (a routing cost reads the curve at up to four batches)."""
    speed = stats.speed
    measured = None
    if stats.step_s is not None and stats.step_batch is not None:
        measured = stats.step_s / stats.tokens_per_step
    if speed is not None:
        if measured is None:
            return speed.tpot_s
        scale = min(max(measured / speed.tpot_s(stats.step_batch), 1.0 / CALIBRATION_LIMIT), CALIBRATION_LIMIT)
        return lambda batch: speed.tpot_s(batch) * scale
    return lambda batch: step_time_s(stats, batch, fixed_share) / stats.tokens_per_step


def predicted_completion_s(stats: RoutingStats, output_tokens: int, now: float, *, load_change: int = 0,
                           finished: int = 0, fixed_share: float = FIXED_STEP_SHARE,
                           tpot: Callable[[float], float] | None = None) -> float:
    """Predicted seconds until a new request of `output_tokens` tokens, sent now (unix s),
    finishes on the replica (the module docstring's model). `load_change`: requests the router
    sent there after `stats.measured_at` less those it saw finish there since, which the stats
    do not show yet (requests; negative when more finished); `finished`: those it saw finish
    (already in `load_change`: a queue's drain since then is only what they do not cover).
    `tpot`: the replica's `tpot_curve`, if the caller has it."""
    tpot = tpot or tpot_curve(stats, fixed_share)
    max_batch = stats.max_batch_size
    output_tokens = max(output_tokens, 1)
    n = max(stats.running + stats.waiting + load_change, 0) + 1
    decode = output_tokens * tpot(min(n, max_batch))
    queue = 0.0
    if n > max_batch:
        mean_output = stats.mean_output_tokens or output_tokens
        slot_s = mean_output * tpot(max_batch) / max_batch
        # The queue kept draining since the stats were measured: by the finishes the router saw
        # (already off n), and by those it did not, one per slot time beyond them.
        unseen_drain = max(now - stats.measured_at - finished * slot_s, 0.0)
        queue = max((n - max_batch) * slot_s - unseen_drain, 0.0)
    return queue + decode


def added_delay_s(stats: RoutingStats, now: float, *, load_change: int = 0, fixed_share: float = FIXED_STEP_SHARE,
                  tpot: Callable[[float], float] | None = None) -> float:
    """Seconds a new request adds, in total, to the requests already decoding on the replica
    (the module docstring's `added`): each of them has about half its output still to make,
    at a slower step once the batch holds one more sequence. `load_change` and `tpot` as in
    predicted_completion_s."""
    decoding = max(stats.running + stats.waiting + load_change, 0)
    if decoding == 0 or decoding >= stats.max_batch_size:
        return 0.0  # nobody there yet, or the batch is full: it waits for a slot, slowing no one
    tpot = tpot or tpot_curve(stats, fixed_share)
    remaining = (stats.mean_output_tokens or DEFAULT_OUTPUT_TOKENS) / 2
    slower = tpot(decoding + 1) - tpot(decoding)
    return decoding * remaining * max(slower, 0.0)


def routing_cost_s(stats: RoutingStats, output_tokens: int, now: float, *, load_change: int = 0,
                   finished: int = 0, fixed_share: float = FIXED_STEP_SHARE) -> float:
    """What sending a request of `output_tokens` tokens to the replica costs, in seconds of
    latency summed over requests: its own predicted completion time plus the time it adds
    to the others there (the module docstring's `cost`)."""
    tpot = tpot_curve(stats, fixed_share)
    return (predicted_completion_s(stats, output_tokens, now, load_change=load_change, finished=finished, tpot=tpot)
            + added_delay_s(stats, now, load_change=load_change, tpot=tpot))


def _is_measured(stats: RoutingStats) -> bool:
    return stats.speed is not None or (stats.step_s is not None and stats.step_batch is not None)


def _fill_unmeasured(stats: list[RoutingStats], fixed_share: float) -> list[RoutingStats] | None:
    """Stats that predict for every replica: one that has neither decoded yet (just started)
    nor heard from the controller gets the fleet's median time per token at batch 1, scaled
    with the batch as measured stats are, as the replicas of one deployment run the same
    model on the same kind of hardware. None when no replica can predict."""
    measured = [s for s in stats if _is_measured(s)]
    if not measured:
        return None
    if len(measured) == len(stats):
        return stats
    tpot_at_1 = statistics.median(tpot_s(s, 1.0, fixed_share) for s in measured)
    fill = {"step_s": tpot_at_1, "step_batch": 1.0, "tokens_per_step": 1.0}
    return [s if _is_measured(s) else s.model_copy(update=fill) for s in stats]


def sample_candidates(candidates: Sequence[T], max_candidates: int | None, rng: random.Random | None = None) -> list[T]:
    """At most `max_candidates` of the candidates, drawn at random (all of them when fewer)."""
    if max_candidates is None or len(candidates) <= max_candidates:
        return list(candidates)
    # random.sample indexes a Sequence (a range too) without copying it: the simulator
    # samples 16 of 1,000 replicas per request.
    return (rng or random).sample(candidates, max_candidates)


def rank_replicas(candidates: Sequence[tuple[ReplicaId, RoutingStats | None]], now: float, max_stats_age_s: float,
                  *, output_tokens: int = DEFAULT_OUTPUT_TOKENS, load_change: Mapping[ReplicaId, int] | None = None,
                  finished: Mapping[ReplicaId, int] | None = None,
                  fixed_share: float = FIXED_STEP_SHARE, tie_tolerance: float = TIE_TOLERANCE,
                  rng: random.Random | None = None) -> list[ReplicaId] | None:
    """The candidates best first by the routing cost of a request of `output_tokens` (its
    predicted completion time plus what it adds to the others there), or None when any
    candidate's stats are missing or older than `max_stats_age_s` (seconds before `now`, unix
    s), or none can predict yet: then the caller routes without them. The replicas within
    `tie_tolerance` of the best come first in random order. `load_change`, `finished`: per
    replica, as in predicted_completion_s."""
    if not candidates:
        return None
    stats = [s for _, s in candidates]
    if any(s is None or now - s.measured_at > max_stats_age_s for s in stats):
        return None
    filled = _fill_unmeasured(stats, fixed_share)  # type: ignore[arg-type]  # no None left
    if filled is None:
        return None
    load_change, finished = load_change or {}, finished or {}
    scored = sorted(
        (routing_cost_s(s, output_tokens, now, load_change=load_change.get(rid, 0), finished=finished.get(rid, 0),
                        fixed_share=fixed_share), i)
        for i, ((rid, _), s) in enumerate(zip(candidates, filled)))
    best = scored[0][0]
    ties = [i for pred, i in scored if pred <= best * (1.0 + tie_tolerance)]
    (rng or random).shuffle(ties)
    rest = [i for pred, i in scored if pred > best * (1.0 + tie_tolerance)]
    return [candidates[i][0] for i in ties + rest]


def choose_replica(candidates: Sequence[tuple[ReplicaId, RoutingStats | None]], now: float, max_stats_age_s: float,
                   *, output_tokens: int = DEFAULT_OUTPUT_TOKENS, load_change: Mapping[ReplicaId, int] | None = None,
                   fixed_share: float = FIXED_STEP_SHARE, tie_tolerance: float = TIE_TOLERANCE,
                   rng: random.Random | None = None) -> ReplicaId | None:
    """The candidate where the request costs least (`rank_replicas`' first), or None
    when the stats cannot tell (missing, stale, none measured): the caller falls back."""
    ranked = rank_replicas(candidates, now, max_stats_age_s, output_tokens=output_tokens, load_change=load_change,
                           fixed_share=fixed_share, tie_tolerance=tie_tolerance, rng=rng)
    return ranked[0] if ranked else None
