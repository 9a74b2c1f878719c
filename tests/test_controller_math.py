"""Step-time model, latency model and policy search, on a synthetic engine (no Ray, no vLLM).

`synthetic_step_time` (testkit.simulated_replica) is a stand-in for a real engine's cost: a memory-bound floor and a
compute slope in batch x tokens (the Su et al. shape), used to check that the models learn
it and that the search picks long chains for small batches and none for large ones."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaspec.policy import PolicyRule, SpecConfig, SpecPolicy
from adaspec.telemetry import StepRecord
from controller.acceptance import expected_accepted_length, marginal_from_conditional
from controller.latency import (
    LatencyCoefficients,
    break_even_rate,
    fit_latency_coefficients,
    operating_point,
)
from controller.policy_search import (
    CostTable, Objective, batch_buckets, bucket_of, candidate_configs, policy_speed, search_policy,
)
from controller.step_time import StepTimeModel
from testkit.simulated_replica import synthetic_step_time


def synthetic_steps(rng, n=600):
    steps = []
    for _ in range(n):
        batch = int(rng.integers(1, 65))
        k = int(rng.integers(0, 5))
        context = batch * int(rng.integers(50, 800))
        prefill = int(rng.choice([0, 0, 0, 64, 256]))
        duration = synthetic_step_time(batch, 1 + k, k, context, prefill) * rng.lognormal(0, 0.03)
        steps.append(StepRecord(time=0, duration_s=duration, batch_size=batch, num_decode_reqs=batch,
                                scheduled_tokens=batch * (1 + k) + prefill, prefill_tokens=prefill,
                                context_tokens=context, config=SpecConfig.chain(k), policy_version=0))
    return steps


def test_step_time_model_learns_the_roofline():
    rng = np.random.default_rng(0)
    model = StepTimeModel(min_samples_xgb=200)
    model.add(synthetic_steps(rng, 40))
    assert model.fit().kind == "linear"
    model.add(synthetic_steps(rng, 1500))
    report = model.fit()
    assert report.kind == "xgboost" and report.holdout_mape < 0.08, report
    # The table the controller searches predicts the true step time at every batch size...
    ks = (0, 2, 4)
    table = CostTable.build(model, [SpecConfig.chain(k) for k in ks], max_batch=64, context_per_seq=300,
                            prefill_per_step=0)
    truth = np.array([[synthetic_step_time(b, 1 + k, k, b * 300, 0) for k in ks] for b in range(1, 65)])
    error = np.abs(table.step_s[1:] / truth - 1)
    assert error.mean() < 0.08 and error.max() < 0.3, (error.mean(), error.max())
    # ...and so the knee: drafting 4 tokens is nearly free for one sequence, dear at batch 64.
    assert table.step_s[1, 2] / table.step_s[1, 0] < 1.4
    assert table.step_s[64, 2] / table.step_s[64, 0] > 2.5


def test_latency_fixed_point_matches_littles_law():
    coeffs = LatencyCoefficients(c1_s=2.0, c2_s=0.1)
    for rate in (0.5, 2.0, 5.0, 9.0):
        point = operating_point(rate, lambda b: coeffs.c1_s + b * coeffs.c2_s, max_batch=10_000)
        assert point.latency_s == pytest.approx(coeffs.mean_latency(rate), rel=1e-3)
        assert point.batch == pytest.approx(coeffs.batch(rate), rel=1e-3)
    assert operating_point(11.0, lambda b: 2.0 + 0.1 * b, max_batch=256).saturated
    fitted = fit_latency_coefficients(np.array([1, 4, 8, 16]), 2.0 + 0.1 * np.array([1, 4, 8, 16]))
    assert fitted.c1_s == pytest.approx(2.0) and fitted.c2_s == pytest.approx(0.1)
    # Speculation halves the empty-server latency but costs more per request: it loses
    # beyond the break-even rate, and there the two latencies are equal.
    base, spec = LatencyCoefficients(2.0, 0.10), LatencyCoefficients(1.0, 0.15)
    rate = break_even_rate(base, spec)
    assert spec.mean_latency(rate) == pytest.approx(base.mean_latency(rate))
    assert spec.mean_latency(rate * 0.5) < base.mean_latency(rate * 0.5)
    assert spec.mean_latency(rate * 1.1) > base.mean_latency(rate * 1.1)


def _costs(max_batch=64, context=300.0):
    configs = candidate_configs(max_k=4, supports_trees=False)
    step = np.array([[synthetic_step_time(b, 1 + c.num_nodes, c.depth, b * context, 0) for c in configs]
                     for b in range(max_batch + 1)])
    return CostTable(configs, step)


def _expected(costs, alpha):
    q = marginal_from_conditional(np.full((16, 8), alpha))
    return np.array([expected_accepted_length(c, q) for c in costs.configs])


def test_search_speculates_when_idle_and_stops_when_busy():
    costs = _costs()
    decision = search_policy(costs, _expected(costs, 0.5), rate=1.0, output_tokens=128)
    policy = decision.policy
    assert policy.config_for(1).depth >= 3            # memory-bound: a long chain
    assert policy.config_for(64).is_off               # compute-bound: verification costs too much
    depths = [policy.config_for(b).depth for b in range(1, 65)]
    assert depths == sorted(depths, reverse=True)     # k falls as the batch grows
    # With acceptance this low nothing pays, at any batch.
    assert str(search_policy(costs, _expected(costs, 0.02), 1.0, 128).policy) == "1+:off"


class PrefillInComputeRoofline:
    """An exact step-time model (synthetic, not fitted) in which a step's prompt tokens
    share the compute with its decode tokens: max(floor, slope * (batch * tokens + prefill))."""

    def predict(self, rows):
        x = np.asarray(rows, dtype=float)
        batch, tokens, depth, context, prefill = x.T
        return np.maximum(0.04, 0.0009 * (batch * tokens + prefill)) + 2e-6 * context + 0.002 * depth


def test_a_bursts_prefill_does_not_make_speculation_look_cheap():
    """Prompt tokens are fixed by the prompts, not by the number of steps: a config that takes
    fewer steps saves none of them. Pricing every config the whole step at a burst's prefill
    made deep chains look cheap; the table prices decode only."""
    configs = candidate_configs(max_k=4, supports_trees=False)
    model = PrefillInComputeRoofline()
    quiet = CostTable.build(model, configs, max_batch=32, context_per_seq=300, prefill_per_step=0)
    burst = CostTable.build(model, configs, max_batch=32, context_per_seq=300, prefill_per_step=2000)
    off = configs.index(SpecConfig.off())
    # `off`'s step is its decode step, whatever the prefill...
    np.testing.assert_allclose(burst.step_s[1:, off], quiet.step_s[1:, off])
    # ...and a config's increment over it is what verifying costs on top of that prefill.
    b, chain2 = 16, configs.index(SpecConfig.chain(2))
    increment = model.predict([[b, 3, 2, b * 300, 2000]])[0] - model.predict([[b, 1, 0, b * 300, 2000]])[0]
    assert burst.step_s[b, chain2] - burst.step_s[b, off] == pytest.approx(increment)
    # So the prefill never makes the search speculate deeper than it would without it.
    expected = _expected(quiet, 0.8)
    calm = search_policy(quiet, expected, 1.0, 128).policy
    busy = search_policy(burst, expected, 1.0, 128).policy
    assert calm.config_for(1).depth >= 3 and calm.config_for(32).depth < calm.config_for(1).depth
    for batch in range(1, 33):
        assert busy.config_for(batch).depth <= calm.config_for(batch).depth, batch
    # A fitted model may price verification cheaper in prompt-heavy steps (its steps with many
    # prompt tokens have few decoding sequences): the table keeps the price without prefill.
    cheaper = CostTable.build(VerifyCheaperWithPrefill(), configs, max_batch=32, context_per_seq=300,
                              prefill_per_step=2000)
    np.testing.assert_allclose(cheaper.step_s, quiet.step_s)


class VerifyCheaperWithPrefill(PrefillInComputeRoofline):
    """The roofline, but in steps that carry prompt tokens a draft token costs next to nothing."""

    def predict(self, rows):
        x = np.asarray(rows, dtype=float)
        without_drafts = x.copy()
        without_drafts[:, 1:3] = (1.0, 0.0)
        return np.where(x[:, 4] > 0, super().predict(without_drafts) + 0.0001 * x[:, 2], super().predict(x))


def test_hysteresis_keeps_a_nearly_as_good_policy():
    costs = _costs()
    expected = _expected(costs, 0.8)
    best = search_policy(costs, expected, 1.0, 128).policy
    assert not search_policy(costs, expected, 1.0, 128, current=best).changed
    # The same table but batch 1 runs one draft token fewer: slightly worse.
    k1 = best.config_for(1).depth
    rules = [PolicyRule(batch_lo=1, batch_hi=1, config=SpecConfig.chain(k1 - 1))] + [
        PolicyRule(batch_lo=max(r.batch_lo, 2), batch_hi=r.batch_hi, config=r.config)
        for r in best.rules if r.batch_hi >= 2]
    current = SpecPolicy(version=0, rules=tuple(rules))
    kept = search_policy(costs, expected, 1.0, 128, current=current, hysteresis=1.0)
    assert not kept.changed and str(kept.policy) == str(current)
    moved = search_policy(costs, expected, 1.0, 128, current=current, hysteresis=0.0)
    assert moved.changed and str(moved.policy) == str(best)


def test_bucket_figures_are_the_means_over_each_buckets_batch_sizes():
    """What a decision and policy_speed report per bucket: the plain mean, over the bucket's
    batch sizes, of tokens/s and of seconds per token under the config run there."""
    costs = _costs()
    expected = _expected(costs, 0.6)
    decision = search_policy(costs, expected, 1.0, 128)
    policy = SpecPolicy.parse("1-3:chain2,4-20:off,21+:chain1", version=7)
    speed = policy_speed(costs, expected, policy)
    assert speed.policy_version == 7 and len(speed.buckets) == len(decision.buckets) == len(costs.buckets)
    for chosen, predicted, (lo, hi) in zip(decision.buckets, speed.buckets, costs.buckets):
        assert (chosen.batch_lo, chosen.batch_hi, predicted.batch_lo, predicted.batch_hi) == (lo, hi, lo, hi)
        c = costs.index[chosen.config]
        assert chosen.tokens_per_s == pytest.approx(np.mean([b * expected[c] / costs.step_s[b, c]
                                                             for b in range(lo, hi + 1)]), rel=1e-12)
        assert chosen.tpot_s == pytest.approx(np.mean([costs.step_s[b, c] / expected[c] for b in range(lo, hi + 1)]),
                                              rel=1e-12)
        run = [costs.index[policy.config_for(b)] for b in range(lo, hi + 1)]
        assert predicted.tpot_s == pytest.approx(np.mean([costs.step_s[b, i] / expected[i]
                                                          for b, i in zip(range(lo, hi + 1), run)]), rel=1e-12)
        assert speed.tpot_s(hi) == predicted.tpot_s and speed.tpot_s(lo - 0.4) == predicted.tpot_s
    assert policy_speed(costs, expected, SpecPolicy.parse("tree2x2")) is None  # not in a chains-only table


def test_tpot_slo_objective_respects_the_slo():
    costs = _costs()
    expected = _expected(costs, 0.6)
    slo = 0.03
    decision = search_policy(costs, expected, 1.0, 128, objective=Objective("tpot_slo", slo))
    for bucket in decision.buckets:
        feasible = [bucket.tpot_s <= slo]
        if any(costs.step_s[bucket.batch_lo, i] / expected[i] <= slo for i in range(len(costs.configs))):
            assert all(feasible), bucket


def test_latency_objective_predicts_the_operating_point():
    costs = _costs()
    decision = search_policy(costs, _expected(costs, 0.7), rate=2.0, output_tokens=100,
                             objective=Objective("latency"))
    assert 1.0 <= decision.operating_batch <= 64
    assert decision.predicted_latency_s > 0


def test_buckets_cover_every_batch():
    buckets = batch_buckets(100)
    assert buckets[0] == (1, 1) and buckets[-1][1] == 100
    assert all(b[0] == a[1] + 1 for a, b in zip(buckets, buckets[1:]))
    assert all(bucket_of(b, 100) == bucket for bucket in buckets for b in range(bucket[0], bucket[1] + 1))
    assert bucket_of(150, 100) == buckets[-1]


def test_request_latency_fit_needs_requests_and_a_spread_of_batches():
    from adaspec.telemetry import RequestRecord
    from controller.latency import MIN_FIT_REQUESTS, fit_request_latency

    def record(batch, latency, tokens=100):
        return RequestRecord(arrival_time=0.0, finish_time=latency, prompt_tokens=10, output_tokens=tokens,
                             mean_batch=batch, config=SpecConfig.chain(2))

    few = [record(1, 2.0)] * (MIN_FIT_REQUESTS - 1)
    assert fit_request_latency("chain2", few) is None
    # One batch size: C2 cannot be told from C1; all of it goes to C1.
    fit = fit_request_latency("chain2", [record(4, 2.0)] * MIN_FIT_REQUESTS)
    assert fit.c2_per_token_s == 0 and fit.c1_per_token_s == pytest.approx(0.02)
    assert fit.batch_lo == fit.batch_hi == 4
    # Requests that produced nothing are not fitted (their latency per token is undefined).
    assert fit_request_latency("chain2", [record(4, 2.0, tokens=0)] * 20) is None


def test_request_lifetimes_name_the_config_that_ran_most_steps():
    from adaspec.telemetry import RequestLifetimes

    lifetimes = RequestLifetimes()
    chain1, chain2 = SpecConfig.chain(1), SpecConfig.chain(2)
    lifetimes.step(["a", "b"], 2, chain2)
    lifetimes.step(["a", "b", "c"], 3, chain1)
    lifetimes.step(["a", "c"], 2, chain1)
    rec = lifetimes.finish("a", arrival_time=10.0, prompt_tokens=5, output_tokens=7, finish_time=12.5)
    assert (rec.config, rec.mean_batch, rec.latency_s, rec.output_tokens) == (chain1, pytest.approx(7 / 3), 2.5, 7)
    lifetimes.discard("b")
    assert lifetimes.finish("b", 0.0, 1, 1) is None
    assert lifetimes.finish("never-ran", 0.0, 1, 1) is None


def test_break_even_rate_with_a_base_fit_without_fixed_cost():
    """A fit of `off` whose intercept is 0 (all its requests ran in large batches) crashed the
    controller's view (division by zero, HTTP 500 from /admin/controller)."""
    from controller.latency import LatencyCoefficients, break_even_rate

    flat = LatencyCoefficients(c1_s=0.0, c2_s=0.5)
    assert break_even_rate(flat, LatencyCoefficients(c1_s=1.0, c2_s=0.1)) == 0.0
    assert break_even_rate(flat, LatencyCoefficients(c1_s=0.0, c2_s=0.6)) == 0.0
    assert break_even_rate(flat, LatencyCoefficients(c1_s=0.0, c2_s=0.4)) == math.inf
    # The usual case is unchanged: C1r = 0.5, (1 - 0.5) / (0.3 - 0.5 * 0.2) = 2.5 req/s.
    assert break_even_rate(LatencyCoefficients(2.0, 0.2), LatencyCoefficients(1.0, 0.3)) == pytest.approx(2.5)


# ---------------------------------------------------------------------------- trees chosen live
def test_tree_envelope_is_the_smallest_uniform_shape_holding_the_tree():
    from controller.policy_search import tree_envelope

    # root children 0, 1; node 0 has children 2, 3; node 2 has child 4
    assert str(tree_envelope([-1, -1, 0, 0, 2])) == "tree2x2x1"
    assert str(tree_envelope([-1, 0, 1])) == "chain3"


def test_tree_candidates_follow_measured_acceptance_per_rank():
    from controller.acceptance import marginal_from_conditional
    from controller.policy_search import candidate_configs, live_tree_configs

    p = np.full((16, 8), 0.02)
    p[:, 0] = 0.8  # the drafter's first guess is nearly always the one: chains, no branching
    assert live_tree_configs(marginal_from_conditional(p), 4, 64) == []
    p[0, 1:3] = 0.6  # its second and third guesses at depth 1 often right: branch there
    trees = live_tree_configs(marginal_from_conditional(p), 4, 64)
    assert trees and all(t.widths[0] >= 2 and all(w == 1 for w in t.widths[1:]) for t in trees), trees
    assert all(t.num_nodes <= 8 for t in live_tree_configs(marginal_from_conditional(p), 4, 8))
    configs = candidate_configs(4, True, marginal_from_conditional(p), 64)
    assert [c for c in configs if not c.is_chain] == trees
    assert candidate_configs(4, False, marginal_from_conditional(p)) == [c for c in configs if c.is_chain]
