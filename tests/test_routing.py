"""Speculation-aware routing: the completion-time model (controller/routing.py), the stats a
replica reports (adaspec/telemetry.py RoutingStats) and their round trip through Serve's
routing-stats dict. Pure: no Ray, no engine."""

from __future__ import annotations

import random

import pytest

from adaspec.policy import SpecConfig
from adaspec.telemetry import ROUTING_STATS_KEY, PolicySpeed, RequestRecord, RoutingStats, SpeedBucket, StepRecord
from controller.routing import (
    CALIBRATION_LIMIT, added_delay_s, choose_replica, predicted_completion_s, rank_replicas, routing_cost_s,
    sample_candidates, step_time_s, tpot_s,
)

NOW = 1_000.0


def stats(running=0, waiting=0, *, step_s=0.1, step_batch=1.0, tokens_per_step=1.0, max_batch=8,
          mean_output=None, age_s=0.1) -> RoutingStats:
    return RoutingStats(running=running, waiting=waiting, max_batch_size=max_batch, step_s=step_s,
                        step_batch=step_batch, tokens_per_step=tokens_per_step,
                        mean_output_tokens=mean_output, measured_at=NOW - age_s)


def test_step_time_scales_from_the_measured_batch():
    s = stats(step_s=0.2, step_batch=4.0)
    assert step_time_s(s, 4) == pytest.approx(0.2)
    assert step_time_s(s, 8) == pytest.approx(0.2 * (0.5 + 0.5 * 2))
    assert step_time_s(s, 8, fixed_share=0.0) == pytest.approx(0.4)
    assert step_time_s(s, 0) == step_time_s(s, 1)  # an empty batch costs what one request does


def test_idle_replica_predicts_its_own_decode():
    # 100 tokens at 0.1 s a step, 1 token a step, batch 1 = the measured batch.
    assert predicted_completion_s(stats(), 100, NOW) == pytest.approx(10.0)
    # Two tokens a step (speculation accepting one draft token on average): half the time.
    assert predicted_completion_s(stats(tokens_per_step=2.0), 100, NOW) == pytest.approx(5.0)


def test_loaded_replica_loses_to_an_idle_one():
    cands = [("busy", stats(running=6, waiting=0)), ("idle", stats())]
    assert choose_replica(cands, NOW, 2.0, output_tokens=64) == "idle"
    assert rank_replicas(cands, NOW, 2.0, output_tokens=64) == ["idle", "busy"]


def test_higher_tokens_per_step_wins_at_equal_load():
    cands = [("plain", stats(running=3, tokens_per_step=1.1)), ("speculates", stats(running=3, tokens_per_step=2.4))]
    for seed in range(10):
        assert choose_replica(cands, NOW, 2.0, output_tokens=64, rng=random.Random(seed)) == "speculates"


def test_good_speculation_can_outweigh_a_little_load():
    # 2 running at 2.5 tokens/step finishes before 1 running at 1 token/step.
    cands = [("light", stats(running=1, tokens_per_step=1.0)), ("spec", stats(running=2, tokens_per_step=2.5))]
    assert choose_replica(cands, NOW, 2.0) == "spec"


@pytest.mark.parametrize("bad", [None, "stale"])
def test_missing_or_stale_stats_mean_no_choice(bad):
    other = stats(age_s=10.0) if bad == "stale" else None
    assert choose_replica([("a", stats()), ("b", other)], NOW, 2.0) is None
    assert rank_replicas([("a", stats()), ("b", other)], NOW, 2.0) is None
    assert choose_replica([], NOW, 2.0) is None


def test_no_replica_measured_means_no_choice():
    unmeasured = stats(step_s=None, step_batch=None)
    assert choose_replica([("a", unmeasured), ("b", unmeasured)], NOW, 2.0) is None


def test_new_replica_borrows_the_fleet_step_time():
    # A replica that has not decoded yet is priced like the others at batch 1: it is idle, so it wins.
    fresh = stats(step_s=None, step_batch=None)
    cands = [("old", stats(running=4, step_s=0.2, step_batch=4.0)), ("new", fresh)]
    assert choose_replica(cands, NOW, 2.0) == "new"


def test_full_batch_waits_for_a_slot():
    # 8 running, 8 max, 4 waiting: the request is 5th in line for a slot. A slot frees every
    # L * t(8) / tokens / 8 seconds: 80 * 0.1 / 1 / 8 = 1 s (step time measured at batch 8).
    full = stats(running=8, waiting=4, step_s=0.1, step_batch=8.0, mean_output=80, age_s=0.0)
    decode = 50 * 0.1
    assert predicted_completion_s(full, 50, NOW) == pytest.approx(5 * 1.0 + decode)
    # Half a second later the queue has drained by half a second.
    assert predicted_completion_s(full, 50, NOW + 0.5) == pytest.approx(4.5 + decode)
    # Queued, it slows no one running there.
    assert added_delay_s(full, NOW) == 0.0
    # A replica with free slots and a slower step still wins against the queue: 50 x 0.15 s
    # for the request, 7 x 20 x 0.0094 s more for the 7 others (40 tokens each, half done).
    slow_free = stats(running=7, step_s=0.15, step_batch=8.0, mean_output=40, age_s=0.0)
    assert routing_cost_s(slow_free, 50, NOW) == pytest.approx(7.5 + 7 * 20 * 0.15 * 0.5 / 8)
    assert choose_replica([("full", full), ("slow-free", slow_free)], NOW, 2.0, output_tokens=50) == "slow-free"


def test_queue_without_finished_requests_uses_the_request_length():
    full = stats(running=8, waiting=0, step_s=0.1, step_batch=8.0, age_s=0.0)
    assert predicted_completion_s(full, 80, NOW) == pytest.approx(1 * 80 * 0.1 / 8 + 80 * 0.1)


def test_requests_sent_since_the_stats_count_as_load():
    cands = [("a", stats()), ("b", stats())]
    assert choose_replica(cands, NOW, 2.0, load_change={"a": 3}) == "b"
    assert choose_replica(cands, NOW, 2.0, load_change={"b": 3}) == "a"


def test_requests_finished_since_the_stats_no_longer_count():
    """A replica whose stats still show the request that just finished there is idle again:
    with the finish counted it ranks by its speed alone; a negative change never makes a
    replica look emptier than empty."""
    fast_busy = stats(running=1, tokens_per_step=1.8)
    slow_idle = stats(running=0, tokens_per_step=1.0)
    cands = [("fast", fast_busy), ("slow", slow_idle)]
    assert predicted_completion_s(fast_busy, 64, NOW, load_change=-1) == pytest.approx(
        predicted_completion_s(stats(running=0, tokens_per_step=1.8), 64, NOW))
    assert choose_replica(cands, NOW, 2.0, output_tokens=64) == "slow"  # as the stats show it
    assert choose_replica(cands, NOW, 2.0, output_tokens=64, load_change={"fast": -1}) == "fast"
    assert predicted_completion_s(slow_idle, 64, NOW, load_change=-3) == predicted_completion_s(slow_idle, 64, NOW)
    assert added_delay_s(fast_busy, NOW, load_change=-1) == 0.0


def test_a_queue_drains_once_whether_the_router_saw_the_finishes_or_not():
    """A full replica with a queue, stats 0.5 s old, a slot freeing every 0.32 s: the router
    that saw one request finish there since takes it off the load, and only the drain beyond
    that one slot off the wait, so it predicts what a router that saw nothing does."""
    full = stats(running=8, waiting=4, step_s=0.1, step_batch=8.0, mean_output=32, age_s=0.5)
    slot_s = 32 * 0.1 / 8
    blind = predicted_completion_s(full, 64, NOW)
    seen = predicted_completion_s(full, 64, NOW, load_change=-1, finished=1)
    assert slot_s == pytest.approx(0.4) and seen == pytest.approx(blind)
    # Counting the drain twice would have taken another 0.4 s off.
    assert predicted_completion_s(full, 64, NOW, load_change=-1) == pytest.approx(blind - slot_s)


def test_ties_are_broken_at_random_among_the_tied():
    cands = [("a", stats()), ("b", stats()), ("loaded", stats(running=5))]
    firsts = {choose_replica(cands, NOW, 2.0, rng=random.Random(seed)) for seed in range(40)}
    assert firsts == {"a", "b"}
    for seed in range(5):
        assert rank_replicas(cands, NOW, 2.0, rng=random.Random(seed))[-1] == "loaded"


def _step(t, *, decode, accepted, duration=0.1, prefill=0):
    return StepRecord(time=t, duration_s=duration, batch_size=decode or 1, num_decode_reqs=decode,
                      scheduled_tokens=decode + prefill, prefill_tokens=prefill, context_tokens=0,
                      config=SpecConfig.parse("chain2"), policy_version=0, num_drafts=decode,
                      draft_k=2, drafted_per_pos=[decode, decode], accepted_per_pos=accepted)


def test_stats_measured_from_steps_and_requests():
    steps = [_step(1.0, decode=0, accepted=[], duration=0.9, prefill=40),  # prefill only: left out
             _step(2.0, decode=2, accepted=[2, 1], duration=0.1),
             _step(3.0, decode=4, accepted=[2, 0], duration=0.3)]
    requests = [RequestRecord(arrival_time=0.0, finish_time=3.0, prompt_tokens=5, output_tokens=30,
                              mean_batch=3.0, config=SpecConfig.parse("chain2"))]
    s = RoutingStats.measure(steps, requests, running=4, waiting=1, max_batch_size=8, measured_at=3.5)
    assert s.step_s == pytest.approx(0.2) and s.step_batch == pytest.approx(3.0)
    assert s.tokens_per_step == pytest.approx((6 + 5) / 6)
    assert s.mean_output_tokens == 30 and (s.running, s.waiting, s.max_batch_size) == (4, 1, 8)
    # Only the most recent decode steps count.
    assert RoutingStats.measure(steps, [], running=0, waiting=0, max_batch_size=8, measured_at=3.5,
                                recent=1).step_s == pytest.approx(0.3)
    # Steps older than max_step_age_s describe the replica no more: a replica whose last steps
    # were slow and that got no request since is unmeasured again, not slow for ever.
    assert RoutingStats.measure(steps, [], running=0, waiting=0, max_batch_size=8, measured_at=3.5,
                                max_step_age_s=1.0).step_s == pytest.approx(0.3)
    later = RoutingStats.measure(steps, requests, running=0, waiting=0, max_batch_size=8, measured_at=3.0 + 21.0)
    assert later.step_s is None and later.tokens_per_step == 1.0 and later.mean_output_tokens == 30


def test_a_replica_that_was_slow_once_gets_requests_again():
    """Its old steps expire: priced by the fleet's median (or the controller's speed), it is
    the idle one, and the next request goes there."""
    busy = stats(running=6)

    def idle_after(seconds: float) -> RoutingStats:
        slow_step = _step(NOW - seconds, decode=1, accepted=[0, 0], duration=0.9)
        return RoutingStats.measure([slow_step], [], running=0, waiting=0, max_batch_size=8, measured_at=NOW - 0.1)
    assert choose_replica([("idle", idle_after(5.0)), ("busy", busy)], NOW, 2.0) == "busy"  # 0.9 s steps, lately
    assert choose_replica([("idle", idle_after(30.0)), ("busy", busy)], NOW, 2.0) == "idle"


def test_stats_before_any_step_are_unmeasured():
    s = RoutingStats.measure([], [], running=0, waiting=0, max_batch_size=8, measured_at=1.0)
    assert s.step_s is None and s.step_batch is None and s.tokens_per_step == 1.0 and s.mean_output_tokens is None


def test_stats_round_trip_through_serves_dict():
    s = stats(running=2, waiting=1, mean_output=40)
    wire = {"kv_events_endpoint": "tcp://x", **s.to_routing_stats()}
    assert isinstance(wire[ROUTING_STATS_KEY], dict)
    assert RoutingStats.from_routing_stats(wire) == s


@pytest.mark.parametrize("wire", [None, {}, {"other": 1}, {ROUTING_STATS_KEY: None},
                                  {ROUTING_STATS_KEY: {"running": -1}}, {ROUTING_STATS_KEY: "x"}, "x"])
def test_missing_or_invalid_stats_parse_to_none(wire):
    assert RoutingStats.from_routing_stats(wire) is None


# ---------------------------------------------------------------- the controller's speed
def speed(*buckets: tuple[int, int, float], version: int = 7) -> PolicySpeed:
    return PolicySpeed(policy_version=version, buckets=[SpeedBucket(batch_lo=lo, batch_hi=hi, tpot_s=t)
                                                        for lo, hi, t in buckets])


def test_speed_curve_lookup_per_bucket():
    curve = speed((1, 1, 0.05), (2, 2, 0.06), (3, 4, 0.1), (5, 8, 0.2))
    assert [curve.tpot_s(b) for b in (0, 1, 2, 3, 4, 5, 8, 30)] == [0.05, 0.05, 0.06, 0.1, 0.1, 0.2, 0.2, 0.2]


def test_speed_alone_predicts_for_a_replica_that_has_not_decoded():
    s = stats(step_s=None, step_batch=None).model_copy(update={"speed": speed((1, 1, 0.05), (2, 8, 0.1))})
    assert tpot_s(s, 1) == pytest.approx(0.05)
    assert predicted_completion_s(s, 100, NOW) == pytest.approx(5.0)
    # It can be ranked without a fallback (a replica that just joined, warm-started).
    assert rank_replicas([("new", s), ("old", stats())], NOW, 2.0) is not None


def test_speed_curve_is_scaled_to_the_measurement():
    # Measured 0.1 s a step at batch 1 and 2 tokens a step: 0.05 s/token, where the models
    # said 0.025: the machine is twice as slow as predicted, at every batch.
    s = stats(step_s=0.1, step_batch=1.0, tokens_per_step=2.0).model_copy(
        update={"speed": speed((1, 1, 0.025), (2, 8, 0.1))})
    assert tpot_s(s, 1) == pytest.approx(0.05)
    assert tpot_s(s, 6) == pytest.approx(0.2)
    # A measurement far off the models moves them by at most CALIBRATION_LIMIT.
    wild = s.model_copy(update={"step_s": 100.0})
    assert tpot_s(wild, 6) == pytest.approx(0.1 * CALIBRATION_LIMIT)


def test_the_policy_in_force_at_the_new_batch_decides():
    # Both replicas measure the same at batch 1 (chain4 accepting well), but one's policy turns
    # speculation off from batch 3, where the models predict it 3x slower per token: with 2
    # running, the request makes it 3, and the other replica is the better place for it.
    measured = dict(step_s=0.1, step_batch=1.0, tokens_per_step=3.0)
    keeps = stats(running=2, **measured).model_copy(update={"speed": speed((1, 2, 0.04), (3, 8, 0.05))})
    turns_off = stats(running=2, **measured).model_copy(update={"speed": speed((1, 2, 0.04), (3, 8, 0.12))})
    for seed in range(5):
        assert choose_replica([("off at 3", turns_off), ("keeps", keeps)], NOW, 2.0,
                              rng=random.Random(seed)) == "keeps"
    # Without the controller's curves the two look the same: a coin toss.
    plain = {choose_replica([("a", stats(running=2, **measured)), ("b", stats(running=2, **measured))], NOW, 2.0,
                            rng=random.Random(seed)) for seed in range(20)}
    assert plain == {"a", "b"}


def test_sample_candidates():
    rng = random.Random(0)
    assert sample_candidates([1, 2, 3], 16, rng) == [1, 2, 3]
    assert sample_candidates([1, 2, 3], None, rng) == [1, 2, 3]
    picked = sample_candidates(list(range(1000)), 16, rng)
    assert len(picked) == 16 == len(set(picked)) and all(0 <= p < 1000 for p in picked)
    assert len({tuple(sample_candidates(list(range(1000)), 16, rng)) for _ in range(5)}) == 5


def test_the_delay_a_request_adds_to_the_others_counts():
    # A speculates well but already runs 2; B is idle and plain. Alone, the request would
    # finish sooner on A (64 x 0.08 = 5.12 s against 6.4 s), but there it slows A's two
    # requests (64 tokens to go each) by 0.02 s a token: 2.56 s in all. B costs less.
    a, b = stats(running=2, tokens_per_step=2.5), stats()
    assert predicted_completion_s(a, 64, NOW) == pytest.approx(5.12)
    assert predicted_completion_s(b, 64, NOW) == pytest.approx(6.4)
    assert added_delay_s(b, NOW) == 0.0
    assert added_delay_s(a, NOW) == pytest.approx(2.56)
    assert routing_cost_s(a, 64, NOW) == pytest.approx(7.68)
    assert choose_replica([("a", a), ("b", b)], NOW, 2.0, output_tokens=64) == "b"
    # Requests sent since the stats count among the others too.
    assert added_delay_s(b, NOW, load_change=1) > 0.0
