"""Acceptance model math: closed forms, Monte Carlo, the tree DP against brute force."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from adaspec.policy import SpecConfig, full_tree_parents
from adaspec.telemetry import StepRecord, decode_tokens_per_s
from controller.acceptance import (
    AcceptanceModel,
    best_tree,
    chain_expected_length,
    expected_accepted_length,
    iid_chain_expected_length,
    marginal_from_conditional,
    measured_proposal_rate,
    ranks_and_depths,
    tree_expected_length,
)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.8, 0.99, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_chain_formula_matches_the_closed_form(alpha, k):
    assert chain_expected_length([alpha] * k) == pytest.approx(iid_chain_expected_length(alpha, k))
    q = marginal_from_conditional(np.full((16, 8), alpha))
    assert expected_accepted_length(SpecConfig.chain(k), q) == pytest.approx(iid_chain_expected_length(alpha, k))


def _simulate(parents: list[int], p: np.ndarray, rng: np.random.Generator, trials: int) -> float:
    """Monte Carlo of verification: walk down from the root; at each node try its children
    in rank order, each accepted with its conditional rate; stop at the first rejection of
    all children. Returns mean accepted nodes + 1 (the bonus token)."""
    ranks, depths = ranks_and_depths(parents)
    kids: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        kids.setdefault(parent, []).append(i)
    total = 0
    for _ in range(trials):
        node, accepted = -1, 0
        while True:
            nxt = None
            for child in kids.get(node, []):
                if rng.random() < p[depths[child] - 1, ranks[child]]:
                    nxt = child
                    break
            if nxt is None:
                break
            node, accepted = nxt, accepted + 1
        total += accepted + 1
    return total / trials


def _random_tree(rng: np.random.Generator, nodes: int, max_children: int) -> list[int]:
    parents: list[int] = []
    counts = {-1: 0}
    for i in range(nodes):
        options = [n for n, c in counts.items() if c < max_children]
        parent = int(rng.choice(options))
        parents.append(parent)
        counts[parent] += 1
        counts[i] = 0
    return parents


@pytest.mark.parametrize("seed", range(6))
def test_tree_formula_matches_monte_carlo(seed):
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.05, 0.9, size=(16, 8))
    parents = _random_tree(rng, nodes=int(rng.integers(3, 20)), max_children=4)
    predicted = tree_expected_length(parents, marginal_from_conditional(p))
    simulated = _simulate(parents, p, rng, trials=60_000)
    assert simulated == pytest.approx(predicted, rel=0.01)


def test_widths_formula_equals_the_explicit_tree():
    rng = np.random.default_rng(0)
    q = marginal_from_conditional(rng.uniform(0.1, 0.9, size=(16, 8)))
    widths = (3, 2, 2, 1)
    parents = full_tree_parents(widths)
    assert expected_accepted_length(SpecConfig.tree(widths), q) == pytest.approx(tree_expected_length(parents, q))
    assert len(parents) == SpecConfig.tree(widths).num_nodes


def _all_trees(budget: int, max_depth: int, max_rank: int):
    """Every tree (children ranks contiguous from 0) with at most `budget` nodes."""

    def forests(depth: int, nodes: int):
        # A list of subtrees (each a list of child-forests) using exactly `nodes` nodes.
        if nodes == 0:
            yield []
            return
        if depth > max_depth:
            return
        for first in range(1, nodes + 1):
            for sub in forests(depth + 1, first - 1):
                for rest in forests_rank(depth, nodes - first, 1):
                    yield [sub, *rest]

    def forests_rank(depth: int, nodes: int, rank: int):
        if nodes == 0:
            yield []
            return
        if rank >= max_rank or depth > max_depth:
            return
        for first in range(1, nodes + 1):
            for sub in forests(depth + 1, first - 1):
                for rest in forests_rank(depth, nodes - first, rank + 1):
                    yield [sub, *rest]

    def to_parents(forest, parent, out):
        ids = []
        for _ in forest:
            out.append(parent)
            ids.append(len(out) - 1)
        for node, sub in zip(ids, forest):
            to_parents(sub, node, out)
        return out

    for n in range(budget + 1):
        for forest in forests(1, n):
            yield to_parents(forest, -1, [])


@pytest.mark.parametrize("seed,budget,depth", [(0, 5, 3), (1, 6, 4), (2, 6, 2), (3, 4, 4), (4, 7, 3)])
def test_best_tree_dp_matches_brute_force(seed, budget, depth):
    rng = np.random.default_rng(seed)
    q = marginal_from_conditional(np.sort(rng.uniform(0.05, 0.95, size=(8, 4)))[:, ::-1].copy())
    value, parents = best_tree(q, budget, depth)
    brute = max(tree_expected_length(t, q) for t in _all_trees(budget, depth, 4))
    assert value == pytest.approx(brute)
    assert tree_expected_length(parents, q) == pytest.approx(value)
    assert len(parents) <= budget and max(ranks_and_depths(parents)[1], default=0) <= depth


def _step(t: float, drafts: int, drafted: list[int], accepted: list[int]) -> StepRecord:
    return StepRecord(time=t, duration_s=0.05, batch_size=drafts, num_decode_reqs=drafts,
                      scheduled_tokens=drafts * (1 + len(drafted)), prefill_tokens=0,
                      context_tokens=100, config=SpecConfig.chain(len(drafted)), policy_version=0,
                      num_drafts=drafts, drafted_per_pos=drafted, accepted_per_pos=accepted)


def test_model_learns_per_position_rates_and_forgets():
    model = AcceptanceModel(half_life_s=10.0, prior_rate=0.3, prior_weight=2.0)
    # 1000 drafts of 3 tokens: 800 accept pos 0, 400 of those accept pos 1, 100 pos 2.
    model.update([_step(100.0, 1000, [1000, 1000, 1000], [800, 400, 100])], now=100.0)
    p = model.conditional_rates()[:3, 0]
    assert p == pytest.approx([0.8, 0.5, 0.25], abs=0.01)
    assert model.expected_length(SpecConfig.chain(3)) == pytest.approx(1 + 0.8 + 0.4 + 0.1, abs=0.02)
    # A workload change: the new rate dominates within a few half-lives.
    model.update([_step(140.0, 1000, [1000, 1000, 1000], [50, 5, 0])], now=140.0)
    assert model.conditional_rates()[0, 0] == pytest.approx(0.05, abs=0.05)
    # No data for a long time (speculation off): the last belief is kept, not the prior;
    # decay stops at min_evidence first-position candidates.
    before = model.conditional_rates()[0, 0]
    model.decay_to(1000.0)
    assert model.reached[0, 0] == pytest.approx(model.min_evidence)
    assert abs(model.conditional_rates()[0, 0] - before) < abs(0.3 - before)


def test_proposal_rate_counts_the_sequences_the_drafter_was_asked_for():
    asked = dataclasses.replace(_step(1.0, 10, [6, 6], [3, 1]), num_drafts=6, draft_k=2)
    unasked = dataclasses.replace(_step(2.0, 10, [], []), num_drafts=0, draft_k=0)
    assert measured_proposal_rate([asked, unasked]) == pytest.approx(0.6)
    assert measured_proposal_rate([unasked]) is None and measured_proposal_rate([]) is None
    # More drafts than decoding sequences (a summarised record): still a share.
    assert measured_proposal_rate([dataclasses.replace(asked, num_drafts=25)]) == 1.0


def test_decode_tokens_per_s_counts_accepted_drafts_and_skips_prefill_steps():
    # Two decode steps of 0.05 s: 4 sequences gaining 4 + (3 + 1) tokens, then 2 gaining 2 + 0.
    steps = [_step(1.0, 4, [4, 4], [3, 1]), _step(2.0, 2, [2, 2], [0, 0])]
    prefill = dataclasses.replace(_step(3.0, 4, [4, 4], [4, 4]), prefill_tokens=50, duration_s=1.0)
    assert decode_tokens_per_s(steps + [prefill]) == pytest.approx((8 + 2) / 0.1)
    assert decode_tokens_per_s([prefill]) == 0.0
