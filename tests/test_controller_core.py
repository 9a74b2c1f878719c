"""ControllerCore with a simulated replica (a stand-in engine: synthetic step times and
acceptance, no Ray, no vLLM): decisions follow load and acceptance, silent replicas are
dropped, a replica that joins starts warm, a checkpoint restores models and policies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, ReplicaTelemetry, RequestRecord, StepRecord
from controller.acceptance import AcceptanceModel
from controller.checkpoint import ControllerCheckpoint
from controller.config import ControllerConfig
from controller.core import EXPLORE_STEPS, ControllerCore
from testkit.simulated_replica import CAPS, INFO, SimulatedReplica, synthetic_step_time

KEY = CAPS.deployment_key("m")  # the simulated replicas' deployment in the controller


def json_round_trip(core: ControllerCore) -> ControllerCheckpoint:
    """The core's checkpoint, written as JSON and read back (as a restarted controller does)."""
    return ControllerCheckpoint.model_validate_json(core.state().model_dump_json())


def test_controller_speculates_at_low_load_and_stops_at_high_load():
    core = ControllerCore(ControllerConfig(enabled=True, half_life_s=5.0, hysteresis=0.03))
    replica = SimulatedReplica("r1", alpha=0.6)
    t = replica.run(core, 1000.0, periods=30, batch=1, arrivals=1)
    low_k = replica.policy.config_for(1).depth
    assert low_k >= 2, replica.policy
    # Saturating load: big batches; the k in force at the running batch falls.
    t = replica.run(core, t, periods=30, batch=48, arrivals=40)
    assert replica.policy.config_for(48).depth < low_k, replica.policy
    # Acceptance collapses: speculation turns off within a few half-lives; afterwards it is
    # switched on only for the periodic one-period probes.
    replica.alpha = 0.01
    t = replica.run(core, t, periods=70, batch=1, arrivals=1)
    late = replica.history[30:]  # six half-lives after the change
    off = sum(p.config_for(1).is_off for p in late)
    assert off >= 0.8 * len(late), [str(p) for p in late]
    assert all(p.config_for(48).is_off for p in late)
    view = core.view(now=t)
    (r,) = view.replicas
    assert r.policy_in_force == str(replica.policy)
    assert view.deployment("m").step_time_model.kind in ("linear", "xgboost")


def test_silent_replicas_are_dropped():
    core = ControllerCore(ControllerConfig(enabled=True, replica_timeout_s=3.0))
    a, b = SimulatedReplica("a", 0.5), SimulatedReplica("b", 0.5, seed=1)
    core.report(a.telemetry(0.0, 1.0, 1, 1), now=1.0)
    core.report(b.telemetry(0.0, 1.0, 1, 1), now=1.0)
    core.report(a.telemetry(1.0, 4.0, 1, 1), now=5.0)
    assert core.drop_stale(now=5.0) == ["b"]
    assert [r.replica_id for r in core.view(now=5.0).replicas] == ["a"]


def test_replica_info_is_asked_for_once():
    """Engine capabilities and node ride on a replica's first report only; a controller that
    does not know the replica (restarted fresh, or it was dropped as silent) asks for them
    instead of guessing, and takes nothing from that report."""
    core = ControllerCore(ControllerConfig(enabled=True, replica_timeout_s=3.0))
    replica = SimulatedReplica("r1", alpha=0.6)
    bare = replica.telemetry(0.0, 1.0, 1, 1).model_copy(update={"info": None})
    assert core.report(bare, now=1.0).send_info
    assert not core.replicas and not core.deployments
    assert not core.report(bare.model_copy(update={"info": INFO}), now=1.0).send_info
    later = replica.telemetry(1.0, 1.0, 1, 1).model_copy(update={"info": None})
    assert not core.report(later, now=2.0).send_info
    (view,) = core.view(now=2.0).replicas
    assert (view.node_id, view.node_ip) == ("node-a", "127.0.0.1")
    assert core.drop_stale(now=10.0) == ["r1"]
    assert core.report(replica.telemetry(10.0, 1.0, 1, 1).model_copy(update={"info": None}), now=11.0).send_info


def test_a_joining_replica_starts_from_its_deployments_acceptance():
    """A replica that joins a deployment (scale-up, restart under a new id) gets its first
    decision from the acceptance its deployment pooled, not from the prior: with acceptance
    0.9 learned by r1, the newcomer's first policy speculates as deep as r1's, while a cold
    controller's first policy for it is shallower (the prior is 0.3)."""
    config = ControllerConfig(enabled=True, half_life_s=5.0, hysteresis=0.03)
    warm = ControllerCore(config)
    r1 = SimulatedReplica("r1", alpha=0.9)
    t = r1.run(warm, 0.0, periods=25, batch=1, arrivals=1)
    learned = r1.policy.config_for(1).depth
    assert learned >= 3, r1.policy

    def first_policy(core: ControllerCore) -> SpecPolicy:
        newcomer = SimulatedReplica("r2", alpha=0.9, seed=1)
        newcomer.policy = SpecPolicy.parse("off")  # nothing drafted yet: nothing of its own to learn from
        pushed = core.report(newcomer.telemetry(t, 1.0, 1, 1), now=t + 1.0).policy
        assert pushed is not None  # within its first control period
        return pushed

    assert first_policy(warm).config_for(1).depth == learned
    assert {r.replica_id: r.started_warm for r in warm.view(now=t + 1.0).replicas} == {"r1": False, "r2": True}
    cold = ControllerCore(config)
    # The same step-time model learned, but no acceptance.
    cold.deployments = {KEY: dataclasses.replace(warm.deployments[KEY], acceptance=AcceptanceModel(half_life_s=5.0))}
    assert first_policy(cold).config_for(1).depth < learned
    view = warm.view(now=t + 1.0).deployment("m")
    assert view.replicas == 2 and view.nodes == 1 and view.conditional_acceptance[0] > 0.8


def test_late_replicas_are_the_ones_to_ask_ray_about():
    """A replica whose report is overdue (1.25 periods) is listed with its actor id, so the
    actor can ask Ray whether it died and drop it at once instead of after the timeout."""
    core = ControllerCore(ControllerConfig(enabled=True, period_s=1.0, replica_timeout_s=30.0))
    a, b = SimulatedReplica("a", 0.5), SimulatedReplica("b", 0.5, seed=1)
    for rid, rep in (("a", a), ("b", b)):
        tel = rep.telemetry(0.0, 1.0, 1, 1)
        core.report(tel.model_copy(update={"info": INFO.model_copy(update={"actor_id": f"actor-{rid}"})}), now=1.0)
    core.report(a.telemetry(1.0, 1.0, 1, 1), now=3.0)
    assert core.late(now=3.0) == {"b": "actor-b"}
    assert core.late(now=2.2) == {}  # 1.2 periods: a report that takes a little longer is not late
    assert core.late(now=2.3) == {"b": "actor-b"}
    assert core.drop(["b"], "its actor died", now=3.5) == ["b"] and list(core.replicas) == ["a"]
    (gone,) = core.view(now=3.5).dropped
    assert (gone.replica_id, gone.node_id, gone.reason, gone.last_report, gone.dropped_at) == (
        "b", "node-a", "its actor died", 1.0, 3.5)


def test_paused_controller_pushes_nothing():
    core = ControllerCore(ControllerConfig(enabled=True))
    core.paused = True
    replica = SimulatedReplica("r1", alpha=0.9)
    assert core.report(replica.telemetry(0.0, 1.0, 1, 1), now=1.0).policy is None


def test_checkpoint_restores_models_and_policies():
    core = ControllerCore(ControllerConfig(enabled=True, half_life_s=5.0))
    replica = SimulatedReplica("r1", alpha=0.6)
    t = replica.run(core, 0.0, periods=20, batch=4, arrivals=3)
    restored = ControllerCore(ControllerConfig(enabled=True, half_life_s=5.0))
    restored.load_state(json_round_trip(core))
    assert restored.restored
    before, after = core.view(now=t), restored.view(now=t)
    assert after.replicas[0].policy_in_force == before.replicas[0].policy_in_force
    assert after.replicas[0].conditional_acceptance == before.replicas[0].conditional_acceptance
    rows = [[4.0, 3.0, 2.0, 1200.0, 0.0], [32.0, 1.0, 0.0, 9600.0, 0.0]]
    assert np.allclose(restored.deployments[KEY].step_model.predict(rows),
                       core.deployments[KEY].step_model.predict(rows))
    # The restored controller keeps deciding from where it stopped.
    assert restored.decide("r1", now=t + 1.0).policy.config_for(4) == SpecConfig.parse(
        str(core.decide("r1", now=t + 1.0).policy.config_for(4)))


def _requests(rng, config: str, n: int, batch: float, c1: float, c2: float, end: float) -> list[RequestRecord]:
    """Finished requests whose latency per output token is c1 + batch x c2, with 3% noise."""
    out = []
    for _ in range(n):
        tokens = int(rng.integers(16, 256))
        latency = tokens * (c1 + batch * c2) * rng.lognormal(0, 0.03)
        out.append(RequestRecord(arrival_time=end - latency, finish_time=end, prompt_tokens=100,
                                 output_tokens=tokens, mean_batch=batch, config=SpecConfig.parse(config)))
    return out


def test_latency_is_fitted_per_config_from_finished_requests():
    """Kong et al.'s C1, C2 per config from measured requests: off costs more per token
    alone, chain2 more per concurrent request, so chain2 loses beyond a break-even rate."""
    rng = np.random.default_rng(0)
    core = ControllerCore(ControllerConfig(enabled=True))
    replica = SimulatedReplica("r1", alpha=0.6)
    truth = {"off": (0.040, 0.002), "chain2": (0.025, 0.004)}
    t = 0.0
    for batch in (1, 2, 4, 8, 16):
        requests = [r for config, (c1, c2) in truth.items() for r in _requests(rng, config, 6, batch, c1, c2, t + 1)]
        tel = replica.telemetry(t, 1.0, batch, arrivals=len(requests)).model_copy(update={"requests": requests})
        t += 1.0
        core.observe(tel, now=t)
    (view,) = core.view(now=t).replicas
    fits = {str(c.fit.config): c for c in view.latency_fits}
    assert set(fits) == {"off", "chain2"}
    for config, (c1, c2) in truth.items():
        fit = fits[config].fit
        assert fit.samples == 30 and (fit.batch_lo, fit.batch_hi) == (1.0, 16.0)
        assert fit.c1_per_token_s == pytest.approx(c1, rel=0.1)
        assert fit.c2_per_token_s == pytest.approx(c2, rel=0.1)
        assert fit.relative_error < 0.05
    # Break-even (Kong et al. eq.): per token, (1 - 0.625) / (0.004 - 0.625 * 0.002) = 136 tokens/s
    # of requests; scaled by the replica's output length.
    expected = (1 - 0.025 / 0.040) / (0.004 - 0.025 / 0.040 * 0.002) / view.output_tokens
    assert fits["chain2"].break_even_rate == pytest.approx(expected, rel=0.15)
    assert fits["off"].break_even_rate is None
    assert view.measured_latency_s is not None and view.measured_latency_s > 0
    # The fits live in the checkpoint.
    restored = ControllerCore(ControllerConfig(enabled=True))
    restored.load_state(json_round_trip(core))
    assert restored.view(now=t).replicas[0].latency_fits == view.latency_fits

def test_the_view_of_one_model_holds_its_deployment_and_replicas_only():
    """`adaspec status --model`: an app with several models has one deployment each."""
    core = ControllerCore(ControllerConfig(enabled=True))
    a, b = SimulatedReplica("a", 0.5, model_id="small"), SimulatedReplica("b", 0.5, seed=1, model_id="large")
    core.report(a.telemetry(0.0, 1.0, 1, 1), now=1.0)
    core.report(b.telemetry(0.0, 1.0, 1, 1), now=1.0)
    view = core.view(now=1.0)
    assert sorted(d.model_id for d in view.deployments) == ["large", "small"]
    small = view.of_model("small")
    assert [r.replica_id for r in small.replicas] == ["a"] and [d.model_id for d in small.deployments] == ["small"]
    assert view.of_model("none").replicas == [] and view.of_model("none").deployments == []


def test_view_with_unbounded_values_survives_json():
    """A latency fit that never saturates has saturation_rate inf, which JSON carries as null:
    `adaspec status` reads the admin route's JSON back into a ControllerView."""
    import math

    from controller.view import ConfigLatency
    from controller.latency import LatencyFit

    fit = LatencyFit(config=SpecConfig.chain(4), samples=8, batch_lo=1.0, batch_hi=1.0, c1_per_token_s=0.06,
                     c2_per_token_s=0.0, relative_error=0.1)
    row = ConfigLatency(fit=fit, c1_s=8.0, c2_s=0.0, saturation_rate=math.inf, latency_at_rate_s=math.inf,
                        break_even_rate=None)
    back = ConfigLatency.model_validate_json(row.model_dump_json())
    assert back.saturation_rate == math.inf and back.latency_at_rate_s == math.inf
    assert back.fit.config == SpecConfig.chain(4)


def test_every_answer_carries_the_predicted_speed_of_the_policy_in_force():
    """The router's input: per batch bucket, seconds per output token under the policy the
    replica runs after this answer; paused, under the policy it keeps."""
    core = ControllerCore(ControllerConfig(enabled=True, half_life_s=5.0))
    good, poor = SimulatedReplica("good", alpha=0.9), SimulatedReplica("poor", alpha=0.1, seed=1)
    t = 0.0
    for _ in range(12):
        for rep in (good, poor):
            reply = core.report(rep.telemetry(t, 1.0, 1, 1), now=t + 1.0)
            if reply.policy is not None:
                rep.policy = reply.policy
            assert reply.speed is not None and reply.speed.policy_version == rep.policy.version
            assert [(b.batch_lo, b.batch_hi) for b in reply.speed.buckets][:4] == [(1, 1), (2, 2), (3, 4), (5, 8)]
            assert reply.speed.buckets[-1].batch_hi == CAPS.max_batch_size
        core.refit()
        t += 1.0
    speeds = {rep.replica_id: core.speed(rep.replica_id, rep.policy, t) for rep in (good, poor)}
    # A replica whose drafts are accepted makes tokens faster at batch 1, and per-token time
    # grows with the batch.
    assert speeds["good"].tpot_s(1) < speeds["poor"].tpot_s(1)
    assert all(s.tpot_s(64) > s.tpot_s(1) for s in speeds.values())
    # The same table on both: only the acceptance differs, and with it the speed.
    same = SpecPolicy.parse("chain4", version=5)
    assert core.speed("good", same, t).tpot_s(1) < core.speed("poor", same, t).tpot_s(1)

    core.paused = True
    manual = SpecPolicy.parse("off", version=good.policy.version + 1)
    good.policy = manual
    reply = core.report(good.telemetry(t, 1.0, 1, 1), now=t + 1.0)
    assert reply.policy is None and reply.speed.policy_version == manual.version


def test_a_replica_on_a_busy_machine_is_priced_at_the_speed_it_runs_at():
    """Issue 51, item 4: the step-time model is fitted over the deployment's history, so it
    cannot see that one replica's machine turned busy (its steps 2.5x slower, the other's
    not). The replica's StepTimeScale does: step times predicted before the steps ran come
    within 20% again, and the router's speed for it follows."""
    core = ControllerCore(ControllerConfig(enabled=True, half_life_s=5.0))
    idle, busy = SimulatedReplica("idle", alpha=0.6), SimulatedReplica("busy", alpha=0.6, seed=1)
    t = 0.0
    for period in range(60):
        if period == 30:
            busy.slowdown = 2.5
        for rep in (idle, busy):
            reply = core.report(rep.telemetry(t, 1.0, 1, 1), now=t + 1.0)
            if reply.policy is not None:
                rep.policy = reply.policy
        core.refit()
        t += 1.0
    views = {r.replica_id: r for r in core.view(now=t).replicas}
    assert views["busy"].step_error < 0.2 and views["idle"].step_error < 0.2, views
    assert views["busy"].step_error_unscaled > 0.3, views["busy"]  # the model alone is far off for it
    assert 2.0 < views["busy"].step_scale / views["idle"].step_scale < 3.0, (views["busy"], views["idle"])
    same = SpecPolicy.parse("chain2", version=5)
    ratio = core.speed("busy", same, t).tpot_s(1) / core.speed("idle", same, t).tpot_s(1)
    assert 2.0 < ratio < 3.0, ratio


def test_an_idle_replica_keeps_its_policy_version():
    """Reports without steps (no traffic) push nothing: the policy version stays put, while a
    replica never decided for still gets its first policy at its first report. Two busy
    periods leave a neighbour config unexplored; the controller used to push the trial and
    the choice by turns, a new version every idle period."""
    core = ControllerCore(ControllerConfig(enabled=True))
    rep = SimulatedReplica("r0", alpha=0.7)
    t = rep.run(core, 0.0, 2, batch=1, arrivals=1)  # briefly busy: decided for
    versions = set()
    for i in range(20):
        idle = rep.telemetry(t + i, 1.0, batch=1, arrivals=0).model_copy(update={"steps": [], "running": 0})
        reply = core.report(idle, now=t + i + 1.0)
        assert reply.policy is None, reply.policy
        versions.add(core.replicas["r0"].policy_in_force.version)
    assert len(versions) == 1

    # A policy set by hand while paused: on resume the controller's comes back at the next
    # report, traffic or not, and then stays put.
    def idle_report(i: int):
        return rep.telemetry(t + i, 1.0, batch=1, arrivals=0).model_copy(update={"steps": [], "running": 0})

    decided = core.replicas["r0"].decision.policy
    manual = SpecPolicy.parse("chain4", version=decided.version + 1)
    assert not manual.same_rules(decided)
    core.paused, rep.policy = True, manual
    assert core.report(idle_report(21), now=t + 22.0).policy is None
    core.paused = False
    back = core.report(idle_report(22), now=t + 23.0).policy
    assert back is not None and back.same_rules(decided) and back.version > manual.version
    rep.policy = back
    assert all(core.report(idle_report(i), now=t + i + 1.0).policy is None for i in range(23, 30))

    newcomer = SimulatedReplica("r1", alpha=0.7).telemetry(t, 1.0, batch=4, arrivals=0)
    first = core.report(newcomer.model_copy(update={"steps": [], "running": 0}), now=t + 1.0)
    assert core.replicas["r1"].decision is not None and first.speed is not None


def test_measured_loss_to_off_switches_speculation_off_even_when_the_models_keep_it():
    """A replica (the simulated stand-in) whose drafts are almost never accepted: chain2 costs
    more per token than off. A hysteresis no gain can clear keeps the models on chain2; the
    safety rule measures off now and then, sees chain2 lose by more than 3%, and puts off in
    place."""
    core = ControllerCore(ControllerConfig(enabled=True, hysteresis=100.0))
    replica = SimulatedReplica("r1", alpha=0.02)
    replica.run(core, 1000.0, periods=150, batch=1, arrivals=1)
    late = replica.history[-40:]
    assert sum(p.config_for(1).is_off for p in late) >= 0.8 * len(late), [str(p) for p in late]
    (r,) = core.view(now=1150.0).replicas
    assert r.safety_overrides > 0


def test_the_safety_rule_keeps_speculation_that_pays():
    core = ControllerCore(ControllerConfig(enabled=True))
    replica = SimulatedReplica("r1", alpha=0.8)
    replica.run(core, 1000.0, periods=150, batch=1, arrivals=1)
    late = replica.history[-40:]
    assert sum(p.config_for(1).depth >= 2 for p in late) >= 0.8 * len(late), [str(p) for p in late]
    (r,) = core.view(now=1150.0).replicas
    assert r.safety_overrides == 0


def test_recurring_exploration_stays_within_its_share_of_steps():
    """Probing chain1 every 2 s while off would spend a third of the steps; the budget holds
    trials near 5% of the recent steps, and the view reports the share."""
    def run(share: float) -> float:
        core = ControllerCore(ControllerConfig(enabled=True, probe_every_s=2.0, max_exploration_share=share))
        replica = SimulatedReplica("r1", alpha=0.01)
        replica.run(core, 1000.0, periods=400, batch=1, arrivals=1)
        (r,) = core.view(now=1400.0).replicas
        return r.exploration_share

    bounded, unbounded = run(0.05), run(1.0)
    assert bounded <= 0.06 and unbounded > 0.2, (bounded, unbounded)


def test_steps_under_a_policy_set_by_hand_spend_no_exploration_budget():
    """Paused in the middle of a trial, the controller still takes reports; the steps that run
    meanwhile under a policy set by hand are not trials. Counted as trials (as they once were),
    a paused test's minutes of steps held exploration above its share for a long time after
    the controller resumed, and it stopped probing."""
    core = ControllerCore(ControllerConfig(enabled=True, probe_every_s=2.0, max_exploration_share=0.2))
    replica = SimulatedReplica("r1", alpha=0.01)
    t = replica.run(core, 1000.0, periods=30, batch=1, arrivals=1)
    rep = core.replicas["r1"]
    for _ in range(60):  # on to a period that starts a trial
        t = replica.run(core, t, periods=1, batch=1, arrivals=1)
        if rep.exploring:
            break
    assert rep.exploring, "no trial in 60 periods"
    core.paused = True
    paused_at = core.view(now=t).replicas[0].exploration_share
    replica.policy = SpecPolicy.parse("chain4", version=replica.policy.version + 1)  # set by hand
    t = replica.run(core, t, periods=120, batch=1, arrivals=1)
    share = core.view(now=t).replicas[0].exploration_share
    # The trial's own steps (reported a period late) count; none of the later ones.
    assert share < paused_at, (paused_at, share)
    # Resumed, it goes on probing.
    core.paused = False
    t = replica.run(core, t, periods=60, batch=1, arrivals=1)
    assert sum(p.config_for(1).depth == 1 for p in replica.history) >= 2, [str(p) for p in replica.history]


def test_the_default_model_starts_from_its_shipped_profile_on_vllm_only():
    def deployment(engine: str, **config):
        core = ControllerCore(ControllerConfig(enabled=True, **config))
        caps = CAPS.model_copy(update={"engine": engine, "max_batch_size": 32})
        info = INFO.model_copy(update={"capabilities": caps})
        core.report(ReplicaTelemetry(replica_id="r", model_id="smollm2-135m-instruct", info=info, window_start=0.0,
                                     window_end=1.0, arrivals=0, finished=0, queue_length=0, running=0,
                                     policy=SpecPolicy.parse("chain2"), steps=[]), now=1.0)
        return core.deployments[caps.deployment_key("smollm2-135m-instruct")]

    shipped = deployment("vllm")
    assert len(shipped.step_model.y) > 1000  # bench/results/profile-cpu-realistic/steps.jsonl
    # Measured in every batch bucket, a burst's (17-32) included: nothing to explore there.
    for lo in (1, 2, 3, 5, 9, 17):
        for k in range(5):
            assert shipped.seen.get((lo, SpecConfig.chain(k)), 0) >= EXPLORE_STEPS, (lo, k)
    assert not deployment("native").step_model.y  # measured on vLLM: says nothing of the native engine
    assert not deployment("vllm", shipped_profile=False).step_model.y


def test_a_tree_engine_gets_trees_from_its_measured_acceptance_not_a_fixed_list():
    """A native (tree) replica, simulated: its steps ran tree2x1, and the drafter's second
    guess at depth 1 was accepted often. The trees the controller prices are the ones the
    dynamic program builds from those counts."""
    from controller.policy_search import TREE_SHAPES, live_tree_configs

    caps = EngineCapabilities(engine="native", max_batch_size=16, max_k=4, supports_trees=True, draft_method="ngram",
                              max_tree_nodes=64)
    info = INFO.model_copy(update={"capabilities": caps})
    core = ControllerCore(ControllerConfig(enabled=True, refit_every_s=1.0))  # trees re-chosen every report
    tree = SpecConfig.parse("tree2x1")
    for i in range(20):
        steps = [StepRecord(time=1000.0 + i + j / 10, duration_s=0.05, batch_size=10, num_decode_reqs=10,
                            scheduled_tokens=50, prefill_tokens=0, context_tokens=3000, config=tree,
                            policy_version=1, num_drafts=10, drafted_per_pos=[10, 9], accepted_per_pos=[9, 6],
                            reached_per_depth_rank=[[10, 7], [9, 0]], accepted_per_depth_rank=[[3, 6], [6, 0]])
                 for j in range(10)]
        core.report(ReplicaTelemetry(replica_id="n1", model_id="m", info=info, window_start=1000.0 + i,
                                     window_end=1001.0 + i, arrivals=1, finished=1, queue_length=0, running=10,
                                     policy=SpecPolicy.parse("tree2x1"), steps=steps), now=1001.0 + i)
    dep = core.deployments[caps.deployment_key("m")]
    built = live_tree_configs(dep.acceptance.marginal_rates(), 4, 64)
    assert built and {c.widths for c in built} != {w for w in TREE_SHAPES if len(w) <= 4}
    assert all(c.widths[0] >= 2 for c in built)
    # Priced: those, and the tree the replica runs now (so that hysteresis can keep it).
    assert [c for c in dep.costs.configs if not c.is_chain] == built + ([tree] if tree not in built else [])
    (view,) = core.view(now=1021.0).replicas
    assert set(view.expected_length) == {str(c) for c in dep.costs.configs}


class SimulatedBudgetReplica(SimulatedReplica):
    """A native replica (stand-in) that also runs per-request budgets: under `auto` each
    sequence verifies `auto_nodes` draft nodes a step and gains `auto_gain` of them."""

    def __init__(self, replica_id: str, alpha: float, auto_nodes: int, auto_gain: float):
        super().__init__(replica_id, alpha)
        self.auto_nodes, self.auto_gain = auto_nodes, auto_gain

    def telemetry(self, start: float, seconds: float, batch: int, arrivals: int) -> ReplicaTelemetry:
        tel = super().telemetry(start, seconds, batch, arrivals)
        caps = CAPS.model_copy(update={"engine": "native", "supports_trees": True, "supports_budgets": True,
                                       "max_tree_nodes": 64})
        steps = []
        for s in tel.steps:
            if s.config.per_request:
                duration = synthetic_step_time(batch, 1 + self.auto_nodes, 0, batch * 300, 0)
                gained = int(self.rng.binomial(batch * self.auto_nodes, self.auto_gain / self.auto_nodes))
                s = dataclasses.replace(s, duration_s=duration, scheduled_tokens=batch * (1 + self.auto_nodes),
                                        num_drafts=batch, draft_k=0, drafted_per_pos=[batch],
                                        accepted_per_pos=[gained], nodes_per_seq=[self.auto_nodes] * batch,
                                        node_budget=batch * self.auto_nodes)
            steps.append(s)
        return tel.model_copy(update={"steps": steps, "info": INFO.model_copy(update={"capabilities": caps})})


@pytest.mark.parametrize("auto_gain,wins", [(2.5, True), (0.2, False)])
def test_per_request_budgets_are_chosen_by_measurement(auto_gain, wins):
    """The models cannot price `auto`; the controller tries it once per bucket, and keeps it
    only where it was measured faster per token than the models' static choice."""
    core = ControllerCore(ControllerConfig(enabled=True))
    replica = SimulatedBudgetReplica("n1", alpha=0.5, auto_nodes=3, auto_gain=auto_gain)
    replica.run(core, 1000.0, periods=200, batch=1, arrivals=1)
    tried = [p for p in replica.history if str(p.config_for(1)) == "auto"]
    assert tried, "auto was never tried"
    late = replica.history[-60:]
    on_auto = sum(str(p.config_for(1)) == "auto" for p in late)
    if wins:
        assert on_auto >= 0.8 * len(late), [str(p) for p in late]
    else:
        assert on_auto <= 0.2 * len(late), [str(p) for p in late]
    # Budget steps never reach the acceptance model (their nodes were picked for looking likely).
    assert core.deployments[core.replicas["n1"].deployment].acceptance.observed_drafts() > 0


def test_one_model_on_two_engines_or_accelerators_is_kept_as_separate_deployments():
    """A step-time model and pooled acceptance per model, engine and accelerator: a native
    and a vLLM replica of one model, or one model on two kinds of GPU, step at different
    speeds (issue 52)."""
    model = "smollm2-135m-instruct"  # the embedded model: adaspec ships its step profile on vLLM, CPU
    core = ControllerCore(ControllerConfig(enabled=True))
    variants = {"vllm-cpu": CAPS, "native-cpu": CAPS.model_copy(update={"engine": "native", "supports_trees": True}),
                "vllm-h100": CAPS.model_copy(update={"accelerator": "NVIDIA H100 80GB HBM3 x2"})}
    for rid, caps in variants.items():
        core.report(ReplicaTelemetry(replica_id=rid, model_id=model, info=INFO.model_copy(update={"capabilities": caps}),
                                     window_start=0.0, window_end=1.0, arrivals=0, finished=0, queue_length=0,
                                     running=0, policy=SpecPolicy.parse("chain2"), steps=[]), now=1.0)
    keys = {caps.deployment_key(model) for caps in variants.values()}
    assert set(core.deployments) == keys and len(keys) == 3
    view = core.view(now=1.0).of_model(model)
    assert {d.key for d in view.deployments} == keys and {d.model_id for d in view.deployments} == {model}
    assert all(d.replicas == 1 for d in view.deployments)
    # The shipped profile of the model on vLLM seeds its vLLM deployment on a CPU only (it was
    # measured on one), not the same engine on a GPU.
    assert core.deployments[variants["vllm-cpu"].deployment_key(model)].step_model.y
    assert not core.deployments[variants["vllm-h100"].deployment_key(model)].step_model.y
