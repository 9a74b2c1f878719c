"""adaspec's vLLM scheduler under both of vLLM 0.32's schedulers (issue 49, item 1), no model.

vLLM's own Scheduler and AsyncScheduler are built from configs alone and driven with
model-runner outputs in the order each engine loop produces them (testkit/vllm_scheduler.py):
sync scheduling hands drafts to the scheduler after each step; async scheduling schedules step
N+1 before step N's output is processed and keeps the drafts in the worker.
"""

from __future__ import annotations

import json

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from adaspec.policy import SpecPolicy
from serve_app.vllm_scheduler import AdaspecAsyncScheduler, AdaspecScheduler, AdaspecSyncScheduler
from testkit import vllm_scheduler as vs

TABLE = [[1, 2, 3], [3, 8, 2]]  # k=3 up to batch 2, k=2 above
MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def engine(async_scheduling: bool, n_requests: int = 2, max_tokens: int = 20, cls=AdaspecScheduler) -> vs.Engine:
    eng = vs.Engine(vs.build(cls, vs.vllm_config(TABLE, async_scheduling)), async_order=async_scheduling)
    eng.add(vs.requests(n_requests, max_tokens=max_tokens))
    return eng


def drain(scheduler) -> list[dict]:
    return json.loads(scheduler("drain"))["steps"]


def spec_lengths(out) -> list[int]:
    return sorted(len(d) for d in out.scheduled_spec_decode_tokens.values())


# ---------------------------------------------------------------------- picking the variant
@MODES
def test_factory_picks_the_variant_from_async_scheduling(async_scheduling):
    scheduler = vs.build(AdaspecScheduler, vs.vllm_config(TABLE, async_scheduling))
    assert type(scheduler) is (AdaspecAsyncScheduler if async_scheduling else AdaspecSyncScheduler)
    assert isinstance(scheduler, AsyncScheduler) == async_scheduling


@pytest.mark.parametrize("cls, async_scheduling", [(AdaspecSyncScheduler, True), (AdaspecAsyncScheduler, False)],
                         ids=["sync-under-async", "async-under-sync"])
def test_a_variant_under_the_other_mode_fails_at_start(cls, async_scheduling):
    with pytest.raises(RuntimeError, match=r"scheduler_config\.async_scheduling.*AdaspecScheduler"):
        vs.build(cls, vs.vllm_config(TABLE, async_scheduling))


def test_vllms_sync_scheduler_under_async_scheduling_verifies_no_draft():
    """Why two variants: the engine under async scheduling never hands drafts to the scheduler,
    so vLLM's synchronous Scheduler schedules none for verification, silently; AsyncScheduler
    schedules placeholders the worker fills. Fails if vLLM 0.32's behaviour changes."""
    plain = engine(True, cls=Scheduler)
    plain.run()
    assert plain.scheduled and not any(out.scheduled_spec_decode_tokens for out in plain.scheduled)
    placeholders = engine(True, cls=AsyncScheduler)
    placeholders.run()
    assert all(spec_lengths(out) == [3, 3] for out in placeholders.scheduled[1:])


# ---------------------------------------------------------------------- the live policy
@MODES
@pytest.mark.parametrize("n_requests, k", [(2, 3), (4, 2)])
def test_drafts_are_verified_at_the_live_policys_k(async_scheduling, n_requests, k):
    eng = engine(async_scheduling, n_requests)
    eng.run()
    first, *decodes = eng.scheduled
    assert not first.scheduled_spec_decode_tokens  # the prefill
    assert first.num_spec_tokens_to_schedule == k
    # Every request in every later step verifies k drafts (under sync the last step may hold
    # fewer requests: one finished a step earlier).
    assert decodes and all(spec_lengths(out) == [k] * len(out.num_scheduled_tokens) for out in decodes)
    assert spec_lengths(decodes[0]) == [k] * n_requests


@MODES
def test_a_pushed_policy_takes_effect_at_the_next_scheduled_step(async_scheduling):
    eng = engine(async_scheduling, max_tokens=30)
    while len(eng.scheduled) < 4:
        eng.step()
    ack = json.loads(eng.scheduler("apply_policy", SpecPolicy.parse("chain1", version=1).model_dump_json()))
    assert ack["status"] == "applied"
    pushed_at = len(eng.scheduled)
    eng.run()
    assert [out.num_spec_tokens_to_schedule for out in eng.scheduled] == [3] * pushed_at + [1] * (
        len(eng.scheduled) - pushed_at)
    # The first step after the push verifies drafts made before it (k=3); every later one k=1.
    assert spec_lengths(eng.scheduled[pushed_at]) == [3, 3]
    assert all(spec_lengths(out) == [1, 1] for out in eng.scheduled[pushed_at + 1:])
    steps = drain(eng.scheduler)
    assert [s["policy_version"] for s in steps] == [0] * pushed_at + [1] * (len(steps) - pushed_at)
    assert [s["draft_k"] for s in steps] == [0] + [3] * pushed_at + [1] * (len(steps) - pushed_at - 1)


# ---------------------------------------------------------------------- step records
@MODES
def test_step_records_equal_vllms_spec_decoding_stats(async_scheduling):
    eng = engine(async_scheduling, n_requests=3)
    eng.run()
    steps = drain(eng.scheduler)
    assert len(steps) == len(eng.scheduled) == len(eng.spec_stats)
    assert sum(s["num_drafts"] for s in steps) > 0
    for step, out, stats in zip(steps, eng.scheduled, eng.spec_stats):
        assert step["batch_size"] == len(out.num_scheduled_tokens)
        assert step["num_decode_reqs"] == len(out.scheduled_spec_decode_tokens)
        assert step["num_drafts"] == (stats.num_drafts if stats else 0)
        assert step["drafted_per_pos"] == (stats.num_draft_tokens_per_pos if stats else [])
        assert step["accepted_per_pos"] == (stats.num_accepted_tokens_per_pos if stats else [])
    assert [s["draft_k"] for s in steps] == [0] + [out.num_spec_tokens_to_schedule for out in eng.scheduled[:-1]]


def test_async_step_records_equal_sync_step_records():
    """Same requests, same acceptances: the records agree field by field (timing aside). Under
    async scheduling a step is scheduled before the previous one's rejections are known, so
    its context counts them until update_from_output takes them off. (Here the requests finish
    in the same step; when one finishes earlier, async scheduling has already scheduled it once
    more, and that step's record counts it, as the GPU runs it.)"""
    records = []
    for async_scheduling in (False, True):
        eng = engine(async_scheduling, n_requests=3)
        eng.run()
        records.append([{k: v for k, v in s.items() if k not in ("time", "duration_s", "overhead_s")}
                        for s in drain(eng.scheduler)])
    sync, async_ = records
    assert any(s["accepted_per_pos"] != s["drafted_per_pos"] for s in sync)  # some drafts were rejected
    assert async_ == sync


class Clock:
    """A clock that advances one unit per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@MODES
def test_step_durations_never_overlap(async_scheduling):
    eng = engine(async_scheduling, n_requests=2)
    scheduler = eng.scheduler
    scheduler._clock = clock = Clock()
    ends = []  # clock at the end of each non-empty update_from_output: the step's last reading
    update = scheduler.update_from_output

    def timed_update(scheduler_output, model_runner_output):
        result = update(scheduler_output, model_runner_output)
        if scheduler_output.total_num_scheduled_tokens:
            ends.append(clock.now)
        return result

    scheduler.update_from_output = timed_update
    eng.run()
    durations = [s["duration_s"] for s in drain(scheduler)]
    assert len(durations) == len(ends) > 3
    assert all(d > 0 for d in durations)
    for previous_end, end, duration in zip(ends, ends[1:], durations[1:]):
        assert end - duration >= previous_end  # [end - duration, end] starts after the step before ended


VLLM_WORK = 1000.0  # clock units each of vLLM's own schedule() and update_from_output() calls take here


@MODES
def test_overhead_counts_adaspecs_own_work_and_none_of_vllms(async_scheduling, monkeypatch):
    """StepRecord.overhead_s is the time spent in adaspec's hooks: vLLM's schedule() and
    update_from_output() advance the clock by VLLM_WORK units, each reading of adaspec's by one,
    so a record that counted any of vLLM's work would hold >= VLLM_WORK."""
    eng = engine(async_scheduling, n_requests=3)
    scheduler = eng.scheduler
    scheduler._clock = clock = Clock()
    base = type(scheduler).__mro__[2]  # vLLM's Scheduler or AsyncScheduler, after AdaspecMixin
    for name in ("schedule", "update_from_output"):
        original = getattr(base, name)

        def slow(self, *args, _original=original, **kwargs):
            clock.now += VLLM_WORK
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(base, name, slow)
    eng.run()
    steps = drain(scheduler)
    assert len(steps) > 3
    assert all(0 < s["overhead_s"] < 20 for s in steps), [s["overhead_s"] for s in steps]
    assert all(s["duration_s"] > VLLM_WORK for s in steps)
