"""Shadow acceptance for prompt lookup (issue 51, item 1), no engine: the shadow drafts are
vLLM's NgramProposer's; driven through vLLM's Scheduler (testkit/vllm_scheduler.py) they
measure every chain's acceptance while `off` runs, equal vLLM's own counts for the k in force
under greedy, and the controller's acceptance model learns from them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import StepRecord, read_profile, step_as_dict
from controller.acceptance import AcceptanceModel, measured_proposal_rate, step_counts
from controller.config import ControllerConfig
from controller.core import ControllerCore
from serve_app.ngram_shadow import SHADOW_SOURCE, NgramShadow, ngram_draft
from serve_app.vllm_scheduler import AdaspecScheduler
from testkit import vllm_scheduler as vs
from testkit.simulated_replica import SimulatedReplica, synthetic_step_time

MAX_K = 4
TABLE = [[1, 8, MAX_K]]
CYCLE = [11, 12, 13, 14, 15, 16, 17, 18]  # a looping text: every n-gram predicts the next token
NEVER_SEEN = 999  # the script's token past max_tokens: no draft can hold it, so none is accepted there


def scripted(policy: str, max_model_len: int = vs.MAX_MODEL_LEN) -> vs.ScriptedEngine:
    scheduler = vs.build(AdaspecScheduler, vs.vllm_config(TABLE, False, max_model_len=max_model_len))
    ack = json.loads(scheduler("apply_policy", SpecPolicy.parse(policy, version=1).model_dump_json()))
    assert ack["status"] == "applied"
    return vs.ScriptedEngine(scheduler, {})


def drain(scheduler) -> list[StepRecord]:
    return [StepRecord(**{**s, "config": SpecConfig.parse(s["config"])}) for s in
            json.loads(scheduler("drain"))["steps"]]


def totals(steps: list[StepRecord]) -> tuple[int, np.ndarray, np.ndarray]:
    seqs = sum(s.shadow_seqs for s in steps)
    drafted = np.sum([s.shadow_drafted_per_pos for s in steps if s.shadow_seqs], axis=0)
    accepted = np.sum([s.shadow_accepted_per_pos for s in steps if s.shadow_seqs], axis=0)
    return seqs, drafted, accepted


def conditional(seqs: int, accepted: np.ndarray) -> list[float]:
    """P(position i accepted | positions < i accepted), sequences without a draft rejected."""
    prev = np.concatenate([[seqs], accepted[:-1]])
    return (accepted / np.maximum(prev, 1)).tolist()


def history_of(rng: random.Random, kind: str, n: int) -> list[int]:
    if kind == "loop":
        return (CYCLE * (n // len(CYCLE) + 1))[:n]
    if kind == "noisy-loop":  # a loop with a token in ten replaced
        return [rng.randrange(40, 60) if rng.random() < 0.1 else CYCLE[i % len(CYCLE)] for i in range(n)]
    return [rng.randrange(100, 100 + 30) for _ in range(n)]  # "random": short n-grams recur, by chance


# ---------------------------------------------------------------------- vLLM's drafter
def test_shadow_drafts_are_vllms_ngram_proposals_for_every_k():
    """The shadow drafts once, at max_k, with vLLM's own helper; vLLM's NgramProposer, asked
    for any k, proposes the first k of those tokens (also near max_model_len, which clips)."""
    eng = scripted("off", max_model_len=200)
    shadow = NgramShadow.for_vllm(eng.scheduler.vllm_config)
    rng = random.Random(0)
    histories = [history_of(rng, kind, n) for kind in ("loop", "noisy-loop", "random")
                 for n in (1, 2, 5, 17, 64, 150, 197, 199)]
    for k in range(1, MAX_K + 1):
        proposed = eng.propose(histories, k)
        for history, vllm_draft in zip(histories, proposed):
            ours = ngram_draft(np.asarray(history, dtype=np.int32), shadow.min_n, shadow.max_n,
                               shadow.max_model_len, shadow.max_k).tolist()
            assert vllm_draft == ours[:k], (k, history[-6:])
    assert any(len(d) == MAX_K for d in eng.propose(histories, MAX_K))


def test_the_shadow_of_a_request_drafts_what_vllm_would_at_each_step():
    """NgramShadow's own bookkeeping (its token buffer, grown as tokens arrive) drafts what
    NgramProposer drafts from the request's history at that step."""
    eng = scripted("off")
    shadow = NgramShadow.for_vllm(eng.scheduler.vllm_config)

    class Request:  # what the shadow reads of vLLM's Request
        def __init__(self, tokens):
            self.all_token_ids, self.num_output_tokens = tokens, 1

    rng = random.Random(1)
    history = history_of(rng, "noisy-loop", 20)
    for _ in range(120):
        history.append(rng.choice(history[-9:]))
        shadow.observe_step(["r"], {"r": Request(list(history))})
        pending = shadow._seqs["r"].drafts
        (expected,) = eng.propose([history], MAX_K)
        if expected:
            assert pending[-1].start == len(history) and pending[-1].tokens == expected
        assert len(pending) <= MAX_K


# ---------------------------------------------------------------------- through vLLM's scheduler
def run_off(prompt: list[int], script: list[int], n_requests: int = 3) -> list[StepRecord]:
    eng = scripted("off")
    for i in range(n_requests):
        eng.add_scripted(str(i), prompt, script + [NEVER_SEEN], max_tokens=len(script))
    eng.run()
    return drain(eng.scheduler)


def test_a_looping_prompt_under_off_shows_high_acceptance_at_every_position():
    steps = run_off(prompt=CYCLE * 8, script=(CYCLE * 8)[:48])
    assert all(s.config.is_off and s.draft_k == 0 and not s.drafted_per_pos for s in steps)  # nothing verified
    assert all(s.shadow_source == SHADOW_SOURCE for s in steps)
    seqs, drafted, accepted = totals(steps)
    assert seqs >= 3 * 40
    rates = conditional(seqs, accepted)
    assert len(rates) == MAX_K and min(rates) > 0.9, rates
    # The controller's estimator reads the same off-steps as that acceptance, at every position.
    model = AcceptanceModel(half_life_s=1e12, prior_weight=1e-6)
    model.update(steps)
    assert np.allclose(model.conditional_rates()[:MAX_K, 0], rates)
    assert measured_proposal_rate(steps) == pytest.approx(drafted[0] / seqs) and drafted[0] / seqs > 0.9


def test_a_prompt_that_does_not_repeat_shows_low_acceptance():
    rng = random.Random(2)
    text = history_of(rng, "random", 112)
    steps = run_off(prompt=text[:64], script=text[64:])
    seqs, drafted, accepted = totals(steps)
    assert seqs >= 3 * 40 and drafted[0] > 0  # short n-grams recur by chance: drafts, mostly wrong
    rates = conditional(seqs, accepted)
    assert rates[0] < 0.2 and accepted.sum() < 0.1 * drafted.sum(), (rates, drafted, accepted)


@pytest.mark.parametrize("policy, k", [("chain2", 2), ("chain4", 4)])
def test_under_greedy_the_shadow_of_the_k_in_force_equals_vllms_counts(policy, k):
    """The shadow at positions < k is what vLLM measured verifying NgramProposer's drafts
    (greedy target); the positions past k are only in the shadow."""
    rng = random.Random(3)
    eng = scripted(policy)
    for i in range(3):
        text = history_of(rng, "noisy-loop", 120)
        eng.add_scripted(str(i), text[:60], text[60:] + [NEVER_SEEN], max_tokens=60)
    eng.run()
    steps = drain(eng.scheduler)
    real_drafted = np.sum([s.drafted_per_pos for s in steps if s.drafted_per_pos], axis=0)
    real_accepted = np.sum([s.accepted_per_pos for s in steps if s.drafted_per_pos], axis=0)
    real_asked = sum(max(s.num_drafts, s.num_decode_reqs) for s in steps if s.draft_k >= 1)
    seqs, drafted, accepted = totals(steps)
    assert 0 < real_accepted[0] < real_drafted[0]  # both accepted and rejected drafts
    assert seqs == real_asked
    assert drafted[:k].tolist() == real_drafted[:k].tolist() and not real_drafted[k:].any()  # vLLM's: max_k long
    assert accepted[:k].tolist() == real_accepted[:k].tolist()


def test_async_scheduling_records_the_same_shadow_as_sync():
    """Under async scheduling a step's output is processed after the next step is scheduled;
    the shadow reads the history at update time in both, so it counts the same (the stand-in
    runner of the existing tests: every token the same, drafts accepted by a fixed pattern)."""
    shadows = []
    for async_scheduling in (False, True):
        eng = vs.Engine(vs.build(AdaspecScheduler, vs.vllm_config(TABLE, async_scheduling)), async_scheduling)
        eng.scheduler("apply_policy", SpecPolicy.parse("off", version=1).model_dump_json())
        eng.add(vs.requests(3, max_tokens=20))
        eng.run()
        shadows.append([(s.shadow_seqs, s.shadow_drafted_per_pos, s.shadow_accepted_per_pos)
                        for s in drain(eng.scheduler)])
    assert shadows[0] == shadows[1]
    assert sum(seqs for seqs, _, _ in shadows[0]) >= 3 * 18


def test_aborted_requests_drop_their_unsettled_drafts():
    eng = scripted("off")
    eng.add_scripted("0", CYCLE * 4, CYCLE * 8, max_tokens=60)
    for _ in range(5):
        eng.step()
    assert eng.scheduler._shadow._seqs["0"].drafts
    from vllm.v1.request import RequestStatus
    eng.scheduler.finish_requests(["0"], RequestStatus.FINISHED_ABORTED)
    assert "0" not in eng.scheduler._shadow._seqs
    assert eng.scheduler._shadow.take().seqs == 0  # nothing settled by the abort


# ---------------------------------------------------------------------- records and the controller
def test_records_without_shadow_fields_still_load():
    old = {k: v for k, v in step_as_dict(StepRecord(
        time=1.0, duration_s=0.1, batch_size=1, num_decode_reqs=1, scheduled_tokens=1, prefill_tokens=0,
        context_tokens=10, config=SpecConfig.off(), policy_version=0)).items() if not k.startswith("shadow")}
    from adaspec.telemetry import _STEP
    step = _STEP.validate_python(old)
    assert (step.shadow_source, step.shadow_seqs, step.shadow_drafted_per_pos) == ("", 0, [])
    _, profiled = read_profile("bench/results/profile-cpu-realistic/steps.jsonl")
    assert profiled and not any(s.shadow_seqs for s in profiled)


def shadow_step(t: float, config: SpecConfig, draft_k: int, real: tuple[list[int], list[int]] | None,
                shadow: tuple[int, list[int], list[int]], batch: int = 8) -> StepRecord:
    drafted, accepted = real or ([], [])
    seqs, s_drafted, s_accepted = shadow
    return StepRecord(time=t, duration_s=0.05, batch_size=batch, num_decode_reqs=batch, scheduled_tokens=batch,
                      prefill_tokens=0, context_tokens=batch * 100, config=config, policy_version=1,
                      num_drafts=drafted[0] if drafted else 0, draft_k=draft_k, drafted_per_pos=drafted,
                      accepted_per_pos=accepted, shadow_source=SHADOW_SOURCE, shadow_seqs=seqs,
                      shadow_drafted_per_pos=s_drafted, shadow_accepted_per_pos=s_accepted)


def test_step_counts_take_the_shadow_only_past_the_verified_positions():
    shadow = (8, [8, 8, 8, 8], [6, 3, 3, 0])
    off = step_counts(shadow_step(1.0, SpecConfig.off(), 0, None, shadow))
    assert off[0][:, 0].tolist() == [8, 6, 3, 3] and off[1][:, 0].tolist() == [6, 3, 3, 0]
    # chain2 verified positions 0-1 (all accepted): those stand; 2-3 come from the shadow.
    chain2 = step_counts(shadow_step(1.0, SpecConfig.chain(2), 2, ([8, 8], [8, 8]), shadow))
    assert chain2[0][:, 0].tolist() == [8, 8, 3, 3] and chain2[1][:, 0].tolist() == [8, 8, 3, 0]


class ShadowReplica(SimulatedReplica):
    """A simulated replica whose steps also carry n-gram shadow counts at acceptance alpha, for
    all MAX_K positions, whatever the policy runs (`shadow` False: an engine without them)."""

    def __init__(self, replica_id: str, alpha: float, shadow: bool, seed: int = 0):
        super().__init__(replica_id, alpha, seed)
        self.shadow = shadow

    def telemetry(self, start, seconds, batch, arrivals):
        tel = super().telemetry(start, seconds, batch, arrivals)
        if self.shadow:
            for s in tel.steps:
                alive, accepted = batch, []
                for _ in range(MAX_K):
                    alive = int(self.rng.binomial(alive, self.alpha))
                    accepted.append(alive)
                s.shadow_source, s.shadow_seqs = SHADOW_SOURCE, batch
                s.shadow_drafted_per_pos, s.shadow_accepted_per_pos = [batch] * MAX_K, accepted
        return tel


@pytest.mark.parametrize("shadow", [True, False], ids=["shadow", "no-shadow"])
def test_while_off_the_controller_learns_acceptance_from_the_shadow(shadow):
    """A replica on a workload the drafter cannot draft for settles at `off` (trying its
    neighbours on the way, so the step-time model knows every chain); then the workload turns
    into one it drafts well. With shadow counts the controller's acceptance model sees it
    while still `off` and leaves `off` within a few periods; without them it would see it only
    through its chain1 probes (none in this window)."""
    core = ControllerCore(ControllerConfig(enabled=True, half_life_s=5.0, hysteresis=0.03, probe_every_s=1e9))
    replica = ShadowReplica("r1", alpha=0.02, shadow=shadow)
    t = replica.run(core, 1000.0, periods=40, batch=1, arrivals=1)
    assert all(p.config_for(1).is_off for p in replica.history[-4:]), [str(p) for p in replica.history]
    rep = core.replicas["r1"]
    assert rep.acceptance.conditional_rates()[0, 0] < 0.2
    replica.alpha = 0.9
    replica.run(core, t, periods=8, batch=1, arrivals=1)
    rates = rep.acceptance.conditional_rates()[:MAX_K, 0]
    if shadow:
        assert min(rates) > 0.5, rates  # every position, though no chain ran
        k = [p.config_for(1).depth for p in replica.history]
        assert k[0] >= 2 and k[-1] >= 3, k  # off -> chainK at the first report after the change
    else:
        assert rates[0] < 0.2 and all(p.config_for(1).is_off for p in replica.history)


def best_static_depth(batch: int, alpha: float) -> int:
    """The chain the simulated replica's truth makes fastest: tokens per second of a batch
    under chainK = batch x E(k) / step time (testkit.simulated_replica's cost)."""
    def tokens_per_s(k: int) -> float:
        expected = sum(alpha ** i for i in range(k + 1))
        return batch * expected / synthetic_step_time(batch, 1 + k, k, batch * 300, 0)
    return max(range(MAX_K + 1), key=tokens_per_s)


@pytest.mark.parametrize("detect", [True, False], ids=["change-detected", "decay-only"])
def test_after_a_workload_change_the_policy_is_the_new_best_within_two_periods(detect):
    """The live test's scenario (issue 51, item 2) on a simulated replica with shadow counts,
    the controller's default half-life (20 s): 8 streams of text drafted badly, then one stream
    of a looping prompt, then the 8 streams again. After each change the policy for the new
    batch is the best static config of the truth by the second report. Decay alone (the
    change test off) keeps the old workload's counts for many reports."""
    core = ControllerCore(ControllerConfig(enabled=True, probe_every_s=1e9))
    replica = ShadowReplica("r1", alpha=0.95, shadow=True)
    t = replica.run(core, 1000.0, periods=30, batch=1, arrivals=1)  # both buckets measured once
    replica.alpha = 0.05
    t = replica.run(core, t, periods=30, batch=8, arrivals=8)
    if not detect:
        core.replicas["r1"].acceptance.change_gap = float("inf")
    for batch, alpha in ((1, 0.95), (8, 0.05)):
        best = best_static_depth(batch, alpha)
        assert replica.policy.config_for(batch).depth != best  # the old workload's choice differs
        replica.alpha = alpha
        t = replica.run(core, t, periods=12, batch=batch, arrivals=batch)
        depths = [p.config_for(batch).depth for p in replica.history]
        if detect:
            assert depths[1:] == [best] * 11, (batch, best, depths)
        else:
            assert depths[:4] != [best] * 4, (batch, best, depths)
    print(f"\nworkload changes seen: {core.replicas['r1'].acceptance.changes}")
