"""The step-cost model (adaspec.step_cost): the fit the native engine's budget planner and the
budget replay use, on steps whose true cost is known."""

from __future__ import annotations

import random

import numpy as np
import pytest

from adaspec.step_cost import StepCost
from native_engine.budget import best_budget


def test_step_cost_fit_recovers_a_roofline_and_never_decreases():
    def true_seconds(seqs, tokens, padded, ctx):  # flat to 8 tokens, then 4 ms a token
        return 0.030 + 0.001 * seqs + 0.004 * max(tokens - 8, 0) + 0.0005 * padded + 0.002 * ctx / 1000

    cost, rng = StepCost(), random.Random(1)
    for _ in range(400):
        seqs, extra, ctx = rng.randint(1, 8), rng.randint(0, 40), rng.randint(100, 8000)
        longest = rng.randint(-(-extra // seqs), extra)  # the nodes spread evenly, or in one tree
        padded = seqs * (1 + longest)
        cost.add(true_seconds(seqs, seqs + extra, padded, ctx), seqs, seqs + extra, padded, ctx)
    for seqs, tokens, padded in ((1, 1, 1), (1, 8, 8), (4, 20, 24), (8, 40, 80)):
        assert cost.seconds(seqs, tokens, padded, 2000) == pytest.approx(true_seconds(seqs, tokens, padded, 2000),
                                                                         rel=0.05)
    even = cost.step_seconds(1, 2000, np.arange(31, dtype=float))
    assert np.all(np.diff(even) > 0)
    assert even[6] - even[0] < 0.006 < even[30] - even[20]  # flat below the knee, steep above
    # 4 sequences, 12 nodes: all in one tree costs more than 3 in each (attention over padding).
    one_tree = cost.step_seconds(4, 2000, np.arange(13, dtype=float))
    spread = cost.step_seconds(4, 2000, np.ceil(np.arange(13) / 4))
    assert one_tree[12] > spread[12] + 0.01


def test_step_cost_fit_prices_the_first_draft_node_apart():
    """A one-token pass runs another path (compiled, or the one-token matmul layout) than a
    verify pass: the first draft node costs 5 ms, the next ones 0.2 ms each."""
    def true_seconds(seqs, tokens):
        return 0.024 + 0.001 * seqs + (0.005 if tokens > seqs else 0.0) + 0.0002 * (tokens - seqs)

    cost, rng = StepCost(), random.Random(2)
    for _ in range(300):
        seqs = rng.randint(1, 4)
        extra = 0 if rng.random() < 0.7 else rng.randint(1, 12)  # mostly undrafted, as budgets run
        cost.add(true_seconds(seqs, seqs + extra), seqs, seqs + extra, seqs * (1 + -(-extra // seqs)), 1000)
    steps = cost.step_seconds(1, 1000, np.arange(9, dtype=float))
    assert steps[0] == pytest.approx(true_seconds(1, 1), abs=5e-4)
    assert steps[1] - steps[0] == pytest.approx(0.0052, abs=1e-3)
    assert steps[8] - steps[1] == pytest.approx(7 * 0.0002, abs=1e-3)
    # A node accepted with p = 0.15 does not pay for the jump (1.15 tokens for 21% more time);
    # four at 0.5, 0.45, 0.4, 0.35 do (2.7 tokens for 24% more).
    assert best_budget([0.15] + [0.0] * 7, 1, steps) == 0
    assert best_budget([0.5, 0.45, 0.4, 0.35] + [0.0] * 4, 1, steps) == 4


def _layout(nodes: list[int]) -> tuple[int, int, int]:
    """(sequences, tokens verified, padded tokens) of a verify pass with these draft nodes per
    sequence, counted as NativeEngine._verify counts them."""
    return len(nodes), sum(n + 1 for n in nodes), len(nodes) * (max(nodes) + 1)


def test_anchors_price_the_budgets_the_engine_did_not_run():
    """The engine's own steps at batch 4 all verify 0 or 1 node per sequence (as a young
    `auto` does): on them alone the fit cannot tell per-token from per-padding cost, and
    misprices four nodes per sequence. Anchors (verify passes of set layouts, 4 ms cheaper
    than a whole step: no drafting or planning in them) make it right."""
    def true_seconds(seqs, tokens, padded, ctx):
        return 0.030 + 0.002 * seqs + 0.0015 * tokens + 0.0006 * padded + 0.002 * ctx / 1000

    def steps(cost):
        rng = random.Random(3)
        for _ in range(400):
            seqs, tokens, padded = _layout([rng.choice((0, 1))] * 4)
            ctx = rng.randint(400, 2000)
            cost.add(true_seconds(seqs, tokens, padded, ctx) + rng.gauss(0, 2e-4), seqs, tokens, padded, ctx)

    alone, anchored = StepCost(), StepCost()
    for batch in (1, 2, 4, 8, 16):
        for ctx in (600, 2000):
            for nodes in ((0,), (1,), (2,), (4,), (1, 0), (4, 0, 0, 0), (8, 0, 0, 0), (0, 1, 2, 4)):
                seqs, tokens, padded = _layout([nodes[i % len(nodes)] for i in range(batch)])
                anchored.add_anchor(true_seconds(seqs, tokens, padded, ctx) - 0.004, seqs, tokens, padded, ctx)
    steps(alone)
    steps(anchored)
    for nodes in ([4] * 4, [8, 0, 0, 0], [2, 2, 0, 0], [1] * 4):
        seqs, tokens, padded = _layout(nodes)
        truth = true_seconds(seqs, tokens, padded, 1200)
        assert anchored.seconds(seqs, tokens, padded, 1200) == pytest.approx(truth, rel=0.02), nodes
    seqs, tokens, padded = _layout([8, 0, 0, 0])
    assert abs(alone.seconds(seqs, tokens, padded, 1200) / true_seconds(seqs, tokens, padded, 1200) - 1) > 0.05, \
        "the steps alone priced a layout they never ran: the anchors prove nothing here"


def test_anchors_count_less_the_further_their_batch_size():
    """Anchors at batch 16 that cost twice what batch 4's say move batch 4's prices little."""
    def true_seconds(seqs, tokens):
        return 0.020 + 0.002 * seqs + 0.001 * tokens

    def anchors(cost, batch, scale):
        for ctx in (500, 2000):
            for nodes in ((0,), (1,), (2,), (4,), (1, 0), (4, 0, 0, 0)):
                seqs, tokens, padded = _layout([nodes[i % len(nodes)] for i in range(batch)])
                cost.add_anchor(scale * true_seconds(seqs, tokens), seqs, tokens, padded, ctx)

    near, both = StepCost(), StepCost()
    anchors(near, 4, 1.0)
    anchors(both, 4, 1.0)
    anchors(both, 16, 2.0)
    for cost in (near, both):  # the engine's own steps: no draft, or a node per sequence
        for i in range(50):
            seqs, tokens, padded = _layout([i % 2] * 4)
            cost.add(true_seconds(seqs, tokens), seqs, tokens, padded, 1000)
    seqs, tokens, padded = _layout([2] * 4)
    assert near.seconds(seqs, tokens, padded, 1000) == pytest.approx(true_seconds(seqs, tokens), rel=0.02)
    assert both.seconds(seqs, tokens, padded, 1000) == pytest.approx(true_seconds(seqs, tokens), rel=0.03)
