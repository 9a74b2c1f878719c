"""SpecAwareRouter (serve_app/router.py) constructed the way Ray Serve's handle constructs it
(ray/serve/_private/router.py), over fake replicas: no Ray cluster, no engine."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from adaspec.telemetry import PolicySpeed, ReplicaInfo, RoutingStats, SpeedBucket
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.request_router import PendingRequest, ReplicaID
from serve_app.router import SpecAwareRouter, request_output_tokens

DEPLOYMENT = DeploymentID(name="SpecReplica:smollm2", app_name="adaspec")


class FakeReplica:
    """What a router reads of a RunningReplica."""

    def __init__(self, name: str, routing_stats: dict, queue_len: int = 0):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats = routing_stats
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 64
        self.is_cross_language = False
        self._queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self._queue_len


def make_router(cls: type = SpecAwareRouter, **kwargs) -> SpecAwareRouter:
    # The keyword arguments of Serve's own construction (Router._initialize_request_router).
    router = cls(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA, self_node_id="node",
        self_actor_id="ingress", self_actor_handle=None, use_replica_queue_len_cache=True,
        create_replica_wrapper_func=lambda info: info, prefer_local_node_routing=False,
        prefer_local_az_routing=False, self_availability_zone=None)
    router.initialize_state(**kwargs)  # request_router_kwargs
    return router


def wire(running=0, waiting=0, *, tokens_per_step=1.0, age_s=0.1, step_s=0.1) -> dict:
    stats = RoutingStats(running=running, waiting=waiting, max_batch_size=8, step_s=step_s, step_batch=1.0,
                         tokens_per_step=tokens_per_step, measured_at=time.time() - age_s)
    return {"kv_events": None, **stats.to_routing_stats()}


def pending(max_tokens: int | None = None, **fields) -> PendingRequest:
    """A request as the ingress sends it (body, raw request info); needs a running loop."""
    body = SimpleNamespace(max_tokens=max_tokens, **fields)
    return PendingRequest(args=[body, None], kwargs={}, metadata=SimpleNamespace(multiplexed_model_id=""))


def route(replicas: list[FakeReplica], max_tokens: int | None = None, **kwargs):
    """(the pending request, the ranks the router chose for it)."""
    async def go():
        router = make_router(**kwargs)
        router.update_replicas(replicas)
        request = pending(max_tokens)
        ranks = await router.choose_replicas(list(replicas), request)
        await asyncio.sleep(0)  # let update_replicas' queue probe finish
        return request, ranks
    return asyncio.run(go())


def test_ranks_every_candidate_best_first_one_per_rank():
    busy, idle, spec = (FakeReplica("busy", wire(running=6)), FakeReplica("idle", wire()),
                        FakeReplica("spec", wire(tokens_per_step=2.5)))
    request, ranks = route([busy, idle, spec], 64)
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["spec"], ["idle"], ["busy"]]
    assert request.routing_context.should_backoff  # all ranked: Serve backs off if all are full


@pytest.mark.parametrize("broken", ["stale", "missing", "invalid"])
def test_stale_or_missing_stats_fall_back_to_power_of_two(broken):
    other = {"stale": wire(age_s=60.0), "missing": {}, "invalid": {"adaspec": {"running": "x"}}}[broken]
    replicas = [FakeReplica("a", wire()), FakeReplica("b", other), FakeReplica("c", wire())]
    _, ranks = route(replicas, 16)
    # Serve's power of two: one rank of two distinct random candidates.
    assert len(ranks) == 1 and len(ranks[0]) == 2 and len({r.replica_id for r in ranks[0]}) == 2
    assert {r.replica_id for r in ranks[0]} <= {r.replica_id for r in replicas}


def test_never_chooses_a_replica_that_is_not_a_candidate():
    alive, dead = FakeReplica("alive", wire(running=7)), FakeReplica("dead", wire())

    async def go():
        router = make_router()
        router.update_replicas([alive, dead])
        router.on_replica_actor_died(dead.replica_id)
        return await router.choose_replicas([alive], pending())
    ranks = asyncio.run(go())
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["alive"]]


def test_requests_sent_since_the_stats_steer_the_next_ones():
    a, b = FakeReplica("a", wire()), FakeReplica("b", wire(running=1))

    async def go():
        router = make_router()
        router.update_replicas([a, b])
        firsts = []
        for _ in range(4):
            (first, *_), *_ = await router.choose_replicas([a, b], pending(32))
            router.on_send_request(first.replica_id)  # what Serve calls once it has sent it
            firsts.append(first.replica_id.unique_id)
        return firsts
    firsts = asyncio.run(go())
    assert firsts[0] == "a" and "b" in firsts  # a takes the first, then the load evens out


def test_a_request_seen_finishing_since_the_stats_no_longer_counts():
    """One client sending lone requests one after another: the fast replica's stats, taken
    while the last request ran there, still show it running; the router saw it finish, so
    the next request goes to the fast replica again, not to the slow idle one."""
    fast, slow = FakeReplica("fast", wire(running=1, tokens_per_step=1.8)), FakeReplica("slow", wire())

    async def go():
        router = make_router()
        router.update_replicas([fast, slow])
        (before, *_), *_ = await router.choose_replicas([fast, slow], pending(64))
        router.on_request_completed(fast.replica_id, "r1")  # what Serve calls when it ends
        (after, *_), *_ = await router.choose_replicas([fast, slow], pending(64))
        return before.replica_id.unique_id, after.replica_id.unique_id
    assert asyncio.run(go()) == ("slow", "fast")


def test_a_large_fleet_is_sampled_down_to_max_candidates():
    """At 1,000 replicas the router scores a random 16 per request, not all of them (the cost
    per request stays a few microseconds a replica scored, whatever the fleet's size)."""
    replicas = [FakeReplica(f"r{i}", wire(running=i % 5)) for i in range(1000)]
    _, ranks = route(replicas, 32)
    chosen = [r.replica_id.unique_id for rank in ranks for r in rank]
    assert len(chosen) == 16 == len(set(chosen)) and set(chosen) <= {f"r{i}" for i in range(1000)}
    _, ranks = route(replicas, 32, max_candidates=4)  # request_router_kwargs
    assert len(ranks) == 4


def test_the_controllers_speed_steers_a_request_off_a_replica_that_slows_at_a_larger_batch():
    def with_speed(tpot_at_3: float) -> dict:
        stats = RoutingStats.from_routing_stats(wire(running=2, tokens_per_step=3.0))
        speed = PolicySpeed(policy_version=1, buckets=[SpeedBucket(batch_lo=1, batch_hi=2, tpot_s=0.03),
                                                       SpeedBucket(batch_lo=3, batch_hi=8, tpot_s=tpot_at_3)])
        return {"kv_events": None, **stats.model_copy(update={"speed": speed}).to_routing_stats()}
    for _ in range(5):
        _, ranks = route([FakeReplica("slows", with_speed(0.1)), FakeReplica("keeps", with_speed(0.04))], 32)
        assert ranks[0][0].replica_id.unique_id == "keeps"


def test_output_tokens_come_from_the_request():
    async def go():
        assert request_output_tokens(pending(17)) == 17
        assert request_output_tokens(None) == request_output_tokens(pending(None)) > 0
        assert request_output_tokens(pending(None, max_completion_tokens=9)) == 9
    asyncio.run(go())


def test_the_class_serve_ships_routes_the_same():
    """Serve cloudpickles the router class by value from its import path and rebuilds it in
    every handle; that copy must construct and rank the same way."""
    from ray.serve.config import RequestRouterConfig

    from serve_app.builder import SPEC_AWARE_ROUTER

    shipped = RequestRouterConfig(request_router_class=SPEC_AWARE_ROUTER).get_request_router_class()
    busy, idle = FakeReplica("busy", wire(running=6)), FakeReplica("idle", wire())

    async def go():
        router = make_router(shipped, max_stats_age_s=2.0)
        router.update_replicas([busy, idle])
        return await router.choose_replicas([busy, idle], pending(8))
    assert [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(go())] == [["idle"], ["busy"]]


@pytest.mark.filterwarnings("ignore:coroutine 'LLMServer.__del__' was never awaited")
def test_replica_reports_its_routing_stats_beside_ray_llms():
    """SpecReplica.record_routing_stats over a fake engine (the replica is built without Serve)."""
    from collections import deque

    from adaspec.engine_contract import EngineReport
    from adaspec.policy import SpecConfig, SpecPolicy
    from adaspec.telemetry import EngineCapabilities, StepRecord
    from serve_app.replica import ReplicaSettings, SpecReplica

    now = time.time()
    step = StepRecord(time=now, duration_s=0.2, batch_size=2, num_decode_reqs=2, scheduled_tokens=6,
                      prefill_tokens=0, context_tokens=10, config=SpecConfig.parse("chain2"), policy_version=0,
                      num_drafts=2, draft_k=2, drafted_per_pos=[2, 2], accepted_per_pos=[2, 1])

    class Engine:
        async def drain_report(self):
            return EngineReport(steps=[step], requests=[], dropped_steps=0, waiting=3, running=2,
                                policy=SpecPolicy.parse("chain2"))

        def routing_stats(self):
            return {"kv_events_endpoint": "tcp://127.0.0.1:1"}

    replica = SpecReplica.__new__(SpecReplica)
    replica.engine = Engine()
    replica._settings = ReplicaSettings()
    replica._steps, replica._requests, replica._arrivals, replica._finishes = deque(), deque(), deque(), deque()
    replica._report = None
    replica._metrics = SimpleNamespace(observe=lambda report: None)
    caps = EngineCapabilities(engine="vllm", max_batch_size=16, max_k=4, supports_trees=False, draft_method="ngram")
    replica._info = ReplicaInfo(capabilities=caps, node_id="node-a", started_at=0.0)
    # The controller's last answer, for the policy in force (version 0).
    replica._speed = PolicySpeed(policy_version=0, buckets=[SpeedBucket(batch_lo=1, batch_hi=16, tpot_s=0.05)])

    async def polled_then_recorded():
        await replica._poll_engine()  # what the replica's poller does every poll_interval_s
        return await replica.record_routing_stats()

    wire = asyncio.run(polled_then_recorded())
    assert wire["kv_events_endpoint"] == "tcp://127.0.0.1:1"  # Ray Serve LLM's own stats stay
    stats = RoutingStats.from_routing_stats(wire)
    assert stats is not None and (stats.running, stats.waiting, stats.max_batch_size) == (2, 3, 16)
    assert stats.step_s == pytest.approx(0.2) and stats.tokens_per_step == pytest.approx(2.5)
    assert abs(stats.measured_at - time.time()) < 5
    assert stats.speed == replica._speed
    # A prediction for another policy than the one in force (a manual change since) is not passed on.
    replica._speed = replica._speed.model_copy(update={"policy_version": 3})
    assert RoutingStats.from_routing_stats(asyncio.run(polled_then_recorded())).speed is None
