"""Per-request speculation budgets (native_engine/budget.py): the selection math without an
engine, then the engine on tiny random models: the budget is respected, a sequence that keeps
rejecting gets no nodes while a greedy one beside it gets many, uneven trees verified in one
packed pass match recomputation from scratch, and the records count every sequence exactly.
Greedy equality under `auto` / `budget6` is in test_native_engine.py (its SHAPES), sampled
exactness in test_native_sampling.py."""

from __future__ import annotations

import random
import time
import types

import numpy as np
import pytest
import torch

from adaspec.policy import SpecPolicy
from native_engine.budget import (
    EXPLORE_EVERY, MAX_EDGE, MIN_P, BudgetPlan, BudgetPlanner, best_budget, best_selection, edge_confidences, hindsight, select_nodes,
)
import native_engine.engine as engine_module
from native_engine.drafters import NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.kv_cache import KVCache
from native_engine.attention import Packing, causal_mask
from native_engine.model import build_model
from native_engine.requests import Request, SamplingParams
from native_engine.testing import tiny_args
from native_engine.tree import DraftTree, attention_mask, batch_tree_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------- the math
def _linear(base_s: float, per_node_s: float, cap: int) -> np.ndarray:
    return base_s + per_node_s * np.arange(cap + 1)


def test_best_budget_keeps_nodes_only_while_they_pay():
    # 4 sequences, a 40 ms step, 5 ms per verified token: a node pays when p > rate x 5 ms.
    assert best_budget([0.95, 0.9, 0.85, 0.1, 0.05], 4, _linear(0.040, 0.005, 5)) == 3
    # Near-ties (within 1% of the best rate) go to fewer nodes: 114.0 tokens/s at B = 2
    # against 114.5 at B = 3; not beyond: 116.4 at B = 3 with a third node of p = 0.7.
    assert best_budget([0.9, 0.8, 0.6, 0.2, 0.1], 4, _linear(0.040, 0.005, 5)) == 2
    assert best_budget([0.9, 0.8, 0.7, 0.2, 0.1], 4, _linear(0.040, 0.005, 5)) == 3
    assert best_budget([0.3, 0.2], 4, _linear(0.040, 0.005, 2)) == 0  # B = 0 is an answer
    assert best_budget([0.9] * 10, 1, _linear(0.040, 0.0001, 4)) == 4  # the cap binds
    assert best_budget([], 3, _linear(0.04, 0.005, 0)) == 0
    # Flat up to 8 nodes, then steep (memory-bound, then compute-bound): less likely nodes ride
    # free below the knee (p = 0.3), and none past it.
    flat_then_steep = np.array([0.05] * 9 + [0.05 + 0.01 * i for i in range(1, 8)])
    assert best_budget([0.5] * 4 + [0.3] * 12, 1, flat_then_steep) == 8


def test_best_selection_cuts_rows_when_the_longest_tree_costs_every_row():
    """A greedy copy's deep chain ranks above every other row's first node; with padded
    attention (each node of the longest tree costs every row) the best set is each row's first
    node, not a prefix of the batch's order. Without that cost it is the prefix best_budget
    picks."""
    chain = [0.9, 0.85, 0.8, 0.75, 0.7, 0.65]
    ranked = [(p, 0, i) for i, p in enumerate(chain)] + [(0.6, s, 0) for s in (1, 2, 3)]

    def padded(longest):  # 40 ms, 1 ms per node, 8 ms per node of the longest tree
        return 0.040 + 0.001 * np.arange(len(longest)) + 0.008 * longest

    chosen = best_selection(ranked, 4, padded)
    assert chosen == [(0.9, 0, 0), (0.6, 1, 0), (0.6, 2, 0), (0.6, 3, 0)]
    prefix = [p for p, _, _ in ranked]
    longest = np.array([0, 1, 2, 3, 4, 5, 6, 6, 6, 6], dtype=float)
    b = best_budget(prefix, 4, padded(longest))
    assert (4 + sum(prefix[:b])) / padded(longest)[b] < (4 + 0.9 + 1.8) / padded(np.array([0, 1, 1, 1, 1.0]))[4]

    def flat(longest):
        return 0.040 + 0.001 * np.arange(len(longest))
    assert best_selection(ranked, 4, flat) == ranked[: best_budget(prefix, 4, flat(longest))]
    assert len(best_selection(ranked, 4, flat, max_nodes=3)) <= 3
    assert best_selection([], 4, flat) == []
    # One sequence: no cut to try, the prefix as best_budget picks it.
    assert best_selection(ranked[:6], 1, flat) == ranked[: best_budget(chain, 1, flat(np.arange(7.0)))]


def test_select_nodes_takes_the_batch_best_and_respects_the_budget():
    probs = [[0.9, 0.5, 0.45], [0.95, 0.0005], [0.6]]
    kept = select_nodes(probs, 4)
    assert kept == [[0, 1], [0], [0]]  # 0.95, 0.9, 0.6, 0.5
    assert sum(map(len, select_nodes(probs, 2))) == 2
    assert select_nodes(probs, 100)[1] == [0]  # below MIN_P is never kept
    assert MIN_P > 0.0005


def _random_tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree(match_len=rng.choice([0, 2, 3, 4]))
    for i in range(n):
        parent = rng.randrange(-1, i)
        base = 1.0 if parent < 0 else tree.scores[parent]
        tree.tokens.append(rng.randrange(50))
        tree.parents.append(parent)
        tree.scores.append(base * rng.uniform(0.05, 1.0))
    return tree


def test_kept_nodes_form_rooted_subtrees_whatever_the_estimates():
    rng = random.Random(0)
    planner = BudgetPlanner()
    for trial in range(50):
        reqs = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=rng.choice([4, 40]),
                                                          temperature=rng.choice([0.0, 0.7, 1.5])), 0.0)
                for i in range(4)]
        for r in reqs:
            r.draft_accepted, r.draft_expected = rng.uniform(0, 5), rng.uniform(0, 5)
        trees = [_random_tree(rng, rng.randrange(0, 12)) for _ in reqs]
        probs = [planner.node_probabilities(r, t)[0] for r, t in zip(reqs, trees)]
        for tree, ps in zip(trees, probs):
            for i, parent in enumerate(tree.parents):
                assert ps[i] <= MAX_EDGE * (1.0 if parent < 0 else ps[parent]) + 1e-12
        for budget in (0, 3, 10, 100):
            for tree, kept in zip(trees, select_nodes(probs, budget)):
                assert all(tree.parents[i] < 0 or tree.parents[i] in kept for i in kept), (trial, budget)


def test_hindsight_reads_each_offered_node_off_the_output():
    # root -> 10 (0), 11 (1); 10 -> 12 (2); 12 -> 13 (3)
    tree = DraftTree(tokens=[10, 11, 12, 13], parents=[-1, -1, 0, 2], scores=[0.6, 0.4, 0.6, 0.6])
    # The output took 10 then 12 then 99: nodes 0 and 2 accepted, 1 and 3 reached and rejected.
    assert hindsight(tree, [10, 12, 99], finished=False) == [(0, True), (1, False), (2, True), (3, False)]
    assert hindsight(tree, [11, 5], finished=False) == [(0, False), (1, True)]  # 11 has no children
    assert hindsight(tree, [7], finished=False) == [(0, False), (1, False)]  # off the tree at once
    assert hindsight(tree, [10], finished=False) is None  # node 2 not decided yet
    assert hindsight(tree, [10], finished=True) == [(0, True), (1, False)]  # the output ended there
    assert hindsight(tree, [], finished=False) is None
    assert hindsight(DraftTree(), [], finished=False) == []


def test_edge_confidence_is_the_path_score_over_the_parents():
    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, 0, 0], scores=[0.8, 0.6, 0.2])
    assert edge_confidences(tree) == pytest.approx([0.8, 0.75, 0.25])


# ----------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def target():
    # init_std 0.15 makes a random model repeat itself, so n-gram drafts get accepted.
    # Head size 8: the model whose drafts these tests' step counts were set for (tiny_args'
    # default, 16, drafts differently; its decode steps are test_native_engine's).
    return build_model(tiny_args(vocab_size=64, head_dim=8), seed=1, init_std=0.15)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (10,), generator=gen).tolist() for _ in range(n)]


def _engine(target, policy: str, batch: int = 6) -> NativeEngine:
    return NativeEngine(target, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=batch, max_seq_len=256),
                        SpecPolicy.parse(policy))


def _hold_step_cost(engine: NativeEngine, per_token_s: float) -> None:
    """Fix `auto`'s step-cost model at a 40 ms step plus `per_token_s` seconds per verified
    token, so which nodes pay does not depend on how fast this machine runs the tiny model
    (a noisy fit on a loaded machine can make every node look too dear)."""
    theta = np.zeros_like(engine.budget.cost.prior)  # [base, per sequence, per token, ...]
    theta[0], theta[2] = 0.040, per_token_s
    engine.budget.cost.coefficients = lambda seqs: theta


def test_calibration_times_every_layout_and_leaves_the_engine_as_it_was(target):
    """calibrate_step_cost gives the fit one anchor per (batch size, prompt length, layout,
    repeat), records no step, holds no request, and what the engine generates after it is
    what a fresh engine generates."""
    from native_engine.engine import CALIBRATION_LAYOUTS, CALIBRATION_REPEATS

    prompts = _prompts(3, seed=5)
    fresh = _engine(target, "auto").generate(prompts, SamplingParams(max_tokens=30))
    engine = _engine(target, "auto")
    engine.calibrate_step_cost(prompt_lengths=(40, 100))
    assert engine.budget.cost.anchors == 4 * 2 * len(CALIBRATION_LAYOUTS) * CALIBRATION_REPEATS  # batches 1, 2, 4, 6
    assert engine.budget.cost.samples == 0 and not engine.drain().steps and not engine.has_unfinished()
    assert engine.generate(prompts, SamplingParams(max_tokens=30)) == fresh
    engine.add_request("late", prompts[0])
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        engine.calibrate_step_cost()


def test_a_second_engine_of_the_same_layout_loads_the_calibration(target, tmp_path, monkeypatch):
    """load_or_calibrate_step_cost times the passes once per key: the next engine of the same
    layout takes the cached passes (the same fit at every batch size, nothing timed), one of
    another layout times its own."""
    monkeypatch.setenv("ADASPEC_CACHE_DIR", str(tmp_path))
    first = _engine(target, "auto", batch=4)
    _, loaded = first.load_or_calibrate_step_cost()
    assert not loaded and first.budget.cost.anchors > 0
    again = _engine(target, "auto", batch=4)
    _, loaded = again.load_or_calibrate_step_cost()
    assert loaded and again.budget.cost.anchor_passes == first.budget.cost.anchor_passes
    for seqs in (1, 2, 3, 4):
        assert np.allclose(again.budget.cost.coefficients(seqs), first.budget.cost.coefficients(seqs))
    assert again.step_cost_key() == first.step_cost_key()
    other = _engine(target, "auto", batch=2)
    assert other.step_cost_key() != first.step_cost_key()
    _, loaded = other.load_or_calibrate_step_cost()
    assert not loaded and {p[1] for p in other.budget.cost.anchor_passes} == {1, 2}


def test_a_replica_that_read_the_matmul_choice_from_the_cache_loads_the_calibration(tmp_path, monkeypatch):
    """A replacement replica reads the matmul paths the replica before it measured: its
    step-cost key names the same paths, so it loads that replica's calibration (the key once
    said "measured" or "cached" too, and a replacement timed its step cost again)."""
    monkeypatch.setenv("ADASPEC_CACHE_DIR", str(tmp_path))
    measured, read = (build_model(tiny_args(vocab_size=64, head_dim=8), seed=1, init_std=0.15).prepare_for_serving()
                      for _ in range(2))
    assert not measured.linear_choice.cached and read.linear_choice.cached
    _, loaded = _engine(measured, "auto", batch=2).load_or_calibrate_step_cost()
    assert not loaded
    _, loaded = _engine(read, "auto", batch=2).load_or_calibrate_step_cost()
    assert loaded


def test_the_node_budget_is_respected_and_recorded_exactly(target):
    engine = _engine(target, "budget5")
    engine.generate(_prompts(6), SamplingParams(max_tokens=60))
    steps = [s for s in engine.drain().steps if s.num_decode_reqs]
    budgeted = [s for s in steps if s.node_budget is not None]
    assert budgeted and all(str(s.config) == "budget5" for s in budgeted)
    assert max(sum(s.nodes_per_seq) for s in budgeted) == 5, "the budget never bound: the test proves nothing"
    for s in steps:
        assert sum(s.nodes_per_seq) == s.node_budget <= 5
        assert len(s.nodes_per_seq) == len(s.accepted_per_seq) == s.num_decode_reqs
        assert sum(s.accepted_per_seq) == sum(s.accepted_per_pos)  # per sequence and per position agree
        assert all(a <= n for a, n in zip(s.accepted_per_seq, s.nodes_per_seq))
        assert s.scheduled_tokens == s.num_decode_reqs + sum(s.nodes_per_seq) + s.prefill_tokens
        assert not s.reached_per_depth_rank  # selection-biased under budgets: not reported per rank


def test_a_sequence_that_keeps_rejecting_gets_no_nodes_beside_a_greedy_one(target):
    """Row 0 greedy (the model repeats itself: drafts accepted), row 1 sampled at T=3 from the
    same prompt (near-uniform over 64 tokens: drafts rejected)."""
    engine = _engine(target, "auto", batch=2)
    # A tiny model's step costs next to nothing, so even unlikely nodes would pay; hold the
    # cost at what SmolLM2-135M's costs on 2 CPU cores (4 ms a verified token).
    _hold_step_cost(engine, per_token_s=0.004)
    prompt = _prompts(1, seed=3)[0]
    engine.add_request("greedy", prompt, SamplingParams(max_tokens=150))
    engine.add_request("hot", prompt, SamplingParams(max_tokens=150, temperature=3.0, seed=1))
    while engine.has_unfinished():
        engine.step()
    steps = [s for s in engine.drain().steps if s.num_decode_reqs == 2 and s.node_budget is not None]
    late = steps[len(steps) // 3:]  # after the estimates have seen each sequence
    greedy = [s.nodes_per_seq[0] for s in late]
    hot = [s.nodes_per_seq[1] for s in late]
    assert sum(s.accepted_per_seq[0] for s in steps) > 20, "the greedy sequence accepted too little to test"
    assert sum(g > 0 for g in greedy) >= 0.2 * len(late), greedy  # drafted whenever prompt lookup matched
    assert sum(h == 0 for h in hot) >= 0.8 * len(late), hot  # the rest: the cost fit's exploration steps
    assert sum(hot) < 0.25 * sum(greedy)


def test_offers_not_verified_are_learned_from_in_hindsight(target):
    """At a step cost that makes every node too dear, `auto` verifies drafts only on its
    exploration steps; its calibration still counts the offered nodes the outputs resolved,
    and for greedy sequences their accepted share is what verifying them would have given."""
    engine = _engine(target, "auto", batch=2)
    _hold_step_cost(engine, per_token_s=1.0)
    engine.generate(_prompts(2, seed=3), SamplingParams(max_tokens=120))
    steps = [s for s in engine.drain().steps if s.node_budget is not None]
    verified = sum(sum(s.nodes_per_seq) for s in steps)
    reached = engine.budget.calibration.reached.sum()
    accepted = engine.budget.calibration.accepted.sum()
    assert verified < 0.2 * sum(s.num_decode_reqs for s in steps), "drafts were verified: the cost did not bind"
    assert reached > 5 * max(verified, 1), (reached, verified)
    assert accepted > 10, "the greedy sequences' offers were never right: the test proves nothing"
    # Greedy: the verified steps' acceptance and the hindsight rate describe the same event.
    measured = sum(sum(s.accepted_per_seq) for s in steps) / max(verified, 1)
    assert abs(measured - accepted / reached) < 0.35, (measured, accepted / reached)
    # The reliability diagram holds every node the outputs went through, and nothing else.
    assert engine.budget.reliability[:, 1].sum() == engine.budget.offered_accepted > 10
    assert (engine.budget.reliability[:, 1] <= engine.budget.reliability[:, 0]).all()


def test_packed_forward_equals_the_padded_one(target):
    """Uneven trees: the packed layout (pads skip every matmul) gives the real tokens the
    same hidden states and writes the same keys/values as the padded layout."""
    rng = random.Random(2)
    trees = [_random_tree(rng, n) for n in (0, 7, 2, 11)]
    lengths = [5, 9, 3, 12]
    roots = [3, 4, 5, 6]
    tokens, pos, write, block = batch_tree_inputs(trees, roots, lengths)
    B, T = tokens.shape
    key_len = max(lengths) + T
    mask = attention_mask(block, torch.tensor(lengths), key_len)
    a = target.args
    real = torch.tensor([b * T + i for b, t in enumerate(trees) for i in range(len(t) + 1)])
    out = {}
    for name in ("padded", "packed"):
        cache = KVCache.allocate(a.n_layers, B, a.n_kv_heads, 64, a.head_dim)
        prefix = torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(0))
        cache.k.copy_(prefix)
        cache.v.copy_(prefix * 0.5)
        with torch.no_grad():
            if name == "packed":
                hidden = target(tokens, pos, mask, cache, 0, write, key_len, Packing(real, B, T))[0]
            else:
                hidden = target(tokens, pos, mask, cache, 0, write, key_len).reshape(B * T, -1)[real]
        out[name] = (hidden, cache)
    assert torch.allclose(out["packed"][0], out["padded"][0], atol=1e-5)
    for b, t in enumerate(trees):  # the real tokens' cache entries; pads may differ
        span = slice(lengths[b], lengths[b] + len(t) + 1)
        assert torch.allclose(out["packed"][1].k[:, b, :, span], out["padded"][1].k[:, b, :, span], atol=1e-5)
        assert torch.allclose(out["packed"][1].v[:, b, :, span], out["padded"][1].v[:, b, :, span], atol=1e-5)


def test_uneven_trees_in_one_pass_match_recomputation(target):
    """After budgeted steps with very different trees per sequence in the same pass, each
    row's KV cache equals a from-scratch forward over its committed tokens."""
    engine = _engine(target, "auto", batch=4)
    _hold_step_cost(engine, per_token_s=0.001)  # cheap nodes: big trees where drafts match
    for i, p in enumerate(_prompts(4, seed=5)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=80, temperature=0.0 if i % 2 == 0 else 1.0, seed=i))
    packed = 0
    for _ in range(25):
        engine.step()
        steps = engine.drain().steps
        if steps and steps[-1].nodes_per_seq:
            nodes = steps[-1].nodes_per_seq
            packed += len(nodes) * (1 + max(nodes)) - sum(1 + n for n in nodes) >= engine_module.PACK_MIN_PADS
    assert packed >= 3, "no pass of uneven trees ran packed: packing and per-row trees not exercised"
    a = target.args
    for req in engine.running:
        committed = req.context[: req.cache_len]
        n = len(committed)
        cache = KVCache.allocate(a.n_layers, 1, a.n_kv_heads, n, a.head_dim)
        pos = torch.arange(n)[None]
        with torch.no_grad():
            target(torch.tensor([committed]), pos,
                   attention_mask(causal_mask(torch.tensor([n]), n)[:, 0], torch.tensor([0]), n), cache, 0, pos, n)
        assert torch.allclose(engine.cache.k[:, req.row, :, :n], cache.k[:, 0, :, :n], atol=1e-5)
        assert torch.allclose(engine.cache.v[:, req.row, :, :n], cache.v[:, 0, :, :n], atol=1e-5)


def test_the_benchmarks_step_profile_groups_steps_by_nodes_per_sequence():
    """bench.native_budget's step profile: a step lands in the bucket of its draft nodes per
    decoding sequence, and each bucket's time share and tokens/s come from its own steps."""
    from types import SimpleNamespace

    from bench.native_budget import step_profile, steps_by_nodes

    def step(nodes, accepted, seconds):
        return SimpleNamespace(num_decode_reqs=len(nodes), nodes_per_seq=nodes, accepted_per_seq=accepted,
                               duration_s=seconds)
    steps = [step([0, 0], [0, 0], 0.1), step([2, 0], [1, 0], 0.2), step([4, 4], [4, 1], 0.3),
             step([9, 0], [3, 0], 0.4)]
    by = steps_by_nodes(steps)
    assert by["0"] == [1, pytest.approx(0.1), 2] and by["<=1"] == [1, pytest.approx(0.2), 3]
    assert by["2-4"] == [1, pytest.approx(0.3), 7] and by[">4"] == [1, pytest.approx(0.4), 5] and by["1-2"][0] == 0
    profile = {b["nodes_per_seq"]: b for b in step_profile([{"steps_by_nodes": by}, {"steps_by_nodes": by}])}
    assert set(profile) == {"0", "<=1", "2-4", ">4"}  # empty buckets left out
    assert profile["2-4"]["tokens_per_s"] == pytest.approx(7 / 0.3) and profile["0"]["step_share"] == 0.25
    assert profile[">4"]["time_share"] == pytest.approx(0.4) and profile["<=1"]["ms_per_step"] == pytest.approx(200)


def test_drafting_stops_when_its_cost_outweighs_what_it_gains(target, monkeypatch):
    """Drafting costs time of its own (a draft model: one pass per depth over every row). With
    a drafter made slow on the engine's clock (prompt lookup, each call advancing the clock the
    engine reads: the stand-in for a draft model's passes, independent of this machine's speed)
    and a 40 ms step without drafts, `auto` stops drafting when drafting takes 20 ms a call and
    a verified node 0.5 s, except now and then to look again (every EXPLORE_EVERY steps at
    most); when drafting takes 2 ms and a node 0.1 ms it drafts several times as often (not
    always: until prompt lookup finds a match, drafting gains nothing). The output is `off`'s
    either way."""
    prompts = _prompts(2, seed=3)
    reference = _engine(target, "off", batch=2).generate(prompts, SamplingParams(max_tokens=80))
    skipped = [0.0]  # seconds the slowed drafter added to the engine's clock
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + skipped[0], time=time.time, monotonic_ns=time.monotonic_ns))
    drafted = {}
    for per_node_s, draft_s in ((0.5, 0.02), (0.0001, 0.002)):
        engine = _engine(target, "auto", batch=2)
        theta = np.zeros_like(engine.budget.cost.prior)  # [base, per sequence, per token, ...]
        theta[0], theta[1], theta[2] = 0.040, -per_node_s, per_node_s  # a step's roots cost the base only
        engine.budget.cost.coefficients = lambda seqs, theta=theta: theta
        calls = []
        propose = engine.drafter.propose

        def slow_propose(contexts, shape, propose=propose, calls=calls, draft_s=draft_s):
            calls.append(len(contexts))
            skipped[0] += draft_s
            return propose(contexts, shape)

        engine.drafter.propose = slow_propose
        assert engine.generate(prompts, SamplingParams(max_tokens=80)) == reference
        steps = [s for s in engine.drain().steps if s.node_budget is not None]
        drafted[per_node_s] = len(calls)
        if per_node_s == 0.5:
            assert 1 <= len(calls) <= len(steps) // EXPLORE_EVERY + 2, (len(calls), len(steps))
    assert drafted[0.0001] > 3 * drafted[0.5], drafted


def test_should_draft_weighs_the_plans_gain_against_the_drafting_seconds():
    planner = BudgetPlanner()
    planner.cost.coefficients = lambda seqs: np.array([0.040, 0, 0.004] + [0.0] * (len(planner.cost.prior) - 3))
    assert planner.should_draft(4, 1000)  # nothing measured yet
    nothing = BudgetPlan(budget=0, predicted=0.0, expected=0.0, verify_extra_s=0.0)
    planner.record_draft(4, 0.010, nothing)  # 10 ms of drafting for no gain
    assert not planner.should_draft(4, 1000)
    planner.record_draft(4, 0.0001, nothing)  # drafting nearly free: it goes on (the calibration learns)
    for _ in range(30):
        planner.record_draft(4, 0.0001, nothing)
    assert planner.should_draft(4, 1000)
    worth = BudgetPlan(budget=8, predicted=4.0, expected=4.0, verify_extra_s=0.032)
    for _ in range(30):
        planner.record_draft(4, 0.010, worth)  # 4 tokens for 32 + 10 ms against a 56 ms bare step
    assert planner.should_draft(4, 1000)
    planner.record_draft(4, 0.5, nothing)
    assert not planner.should_draft(4, 1000)
    assert planner.draft_wait == 2 * EXPLORE_EVERY  # drafting did not pay after a drafted step: look again later
    planner.undrafted_steps = 2 * EXPLORE_EVERY
    assert planner.should_draft(4, 1000) and planner.explore_next
