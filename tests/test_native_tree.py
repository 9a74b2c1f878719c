"""Token trees, verification rules, drafters and acceptance counting, without an engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from adaspec.policy import SpecConfig, full_tree_parents
from controller.acceptance import ranks_and_depths
from native_engine.drafters import DraftModelDrafter, NgramDrafter
from native_engine.model import build_model
from native_engine.requests import Request, SamplingParams
from native_engine.stats import AcceptanceCounts
from native_engine.testing import tiny_args
from native_engine.tree import (
    DraftTree,
    TreeShape,
    attention_mask,
    batch_tree_inputs,
    prune_best_first,
    tree_mask,
)
from native_engine.verify import (
    NUCLEUS_TOP_K,
    accept_greedy,
    accept_sampled,
    accept_sampled_from_draft,
    probs_from_logits,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------- trees
@pytest.mark.parametrize("widths", [(1,), (1, 1, 1, 1), (2, 2), (4, 2, 2, 1), (3, 1, 2)])
def test_full_tree_matches_the_config_and_the_controller_conventions(widths):
    parents = full_tree_parents(widths)
    assert len(parents) == SpecConfig(widths=widths).num_nodes
    ranks, depths = ranks_and_depths(parents)  # the controller's reading of a parents array
    assert max(depths) == len(widths)
    for d, w in enumerate(widths, start=1):
        assert max(r for r, dd in zip(ranks, depths) if dd == d) == w - 1
    assert DraftTree([0] * len(parents), parents, [1.0] * len(parents)).depths() == depths


def test_tree_mask_is_the_ancestor_relation():
    parents = full_tree_parents((2, 2, 1))
    mask = tree_mask(parents)
    for i in range(len(parents) + 1):
        ancestors, node = {i}, i - 1
        while node >= 0:
            node = parents[node]
            ancestors.add(node + 1)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == ancestors


def test_batch_inputs_positions_by_depth_and_mask_with_prefix():
    trees = [DraftTree([7, 8, 9], [-1, -1, 0], [1, 1, 1]), DraftTree()]
    tokens, pos, write, block = batch_tree_inputs(trees, roots=[5, 6], lengths=[4, 2])
    assert tokens.tolist() == [[5, 7, 8, 9], [6, 0, 0, 0]]
    assert pos[0].tolist() == [4, 5, 5, 6] and write[0].tolist() == [4, 5, 6, 7]
    mask = attention_mask(block, torch.tensor([4, 2]), key_len=8)[:, 0]
    # node 2 (row 3) sees the 4 prefix positions, the root (4), node 0 (5) and itself (7).
    assert torch.nonzero(mask[0, 3]).flatten().tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert torch.nonzero(mask[1, 0]).flatten().tolist() == [0, 1, 2]  # root of row 1, prefix 2
    assert mask[1, 2].sum() == 3  # a pad row sees the prefix and itself, never a NaN row


def test_best_first_pruning_keeps_a_subtree_of_the_most_likely_paths():
    # root -> a (0.6) -> c (0.5), d (0.1); root -> b (0.3) -> e (0.25)
    tree = DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 1], [0.6, 0.3, 0.5, 0.1, 0.25])
    kept = prune_best_first(tree, 3)
    assert kept.tokens == [1, 2, 3] and kept.parents == [-1, -1, 0]
    assert prune_best_first(tree, 10) is tree
    shape = TreeShape.from_config(SpecConfig.parse("tree4x2x2x1"), budget=12)
    assert (shape.max_nodes, shape.full_nodes, str(shape)) == (12, 44, "tree4x2x2x1@12")
    # Levels of 4, 8, 16, 16 nodes in full; best-first gives children to at most 12 nodes of
    # a level, so the last has at most 12.
    assert (shape.expanded_nodes, TreeShape((4, 2, 2, 1)).expanded_nodes) == (40, 44)


# ----------------------------------------------------------------------------------- verify
def test_greedy_acceptance_takes_the_matching_branch():
    tree = DraftTree([7, 8, 9, 3], [-1, -1, 1, 1], [1] * 4)  # root: 7, 8; 8: 9, 3
    children = tree.children()
    # target argmax per verify row (root, node0..3): root wants 8, node1 (8) wants 3, node3 wants 4
    result = accept_greedy(children, tree.tokens, [8, 0, 3, 0, 4])
    assert result.path == [0, 2, 4] and result.ranks == [1, 1] and result.tokens == [8, 3, 4]
    none = accept_greedy(children, tree.tokens, [5, 0, 0, 0, 0])
    assert none.path == [0] and none.ranks == [] and none.tokens == [5]


def test_top_p_keeps_the_nucleus():
    probs = probs_from_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 1.0, top_p=0.7)
    assert torch.allclose(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]), atol=1e-6)


# Rows whose nucleus fits the first top-k (64), the second (1024), and none (a full sort).
@pytest.mark.parametrize("scale, nucleus", [(6.0, (1, 64)), (2.8, (65, 1024)), (0.5, (1025, 49152))])
def test_top_p_on_a_large_vocabulary_equals_the_nucleus_of_a_full_sort(scale, nucleus):
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)) * scale
    probs = probs_from_logits(logits, 0.7, top_p=0.9)
    full = torch.softmax(logits / 0.7, dim=-1)
    sorted_p, order = full.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < 0.9
    expected = torch.zeros_like(full).scatter_(-1, order, sorted_p * keep)
    expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(probs, expected, atol=1e-7)
    kept = (probs > 0).sum(-1)
    assert bool(((kept >= nucleus[0]) & (kept <= nucleus[1])).all()), kept
    assert nucleus[1] in NUCLEUS_TOP_K + (49152,)


def _two_level_tree():
    # root -> 0 (token 1), 1 (token 2), 2 (token 3); node 0 -> 3 (token 0), 4 (token 2)
    return DraftTree([1, 2, 3, 0, 2], [-1, -1, -1, 0, 0], [1.0] * 5)


def _exact_two_token_distribution(probs: torch.Tensor, tree: DraftTree) -> np.ndarray:
    """P(first, second) of the target: rows are root and nodes; only the path via node 0
    has a second-level row, others have the bonus only (second = -1 marks 'stopped')."""
    V = probs.shape[1]
    out = np.zeros((V, V + 1))
    for x in range(V):
        px = float(probs[0, x])
        if x == 1:  # node 0 accepted -> the second token comes from row 1
            out[x, :V] = px * probs[1].numpy()
        else:
            out[x, V] = px
    return out


def _run_two_token(accept, probs, tree, n, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    V = probs.shape[1]
    counts = np.zeros((V, V + 1))
    children = tree.children()
    for _ in range(n):
        r = accept(children, tree.tokens, probs, generator=gen, **kw)
        first = r.tokens[0]
        second = r.tokens[1] if first == 1 else V  # beyond node 0 the tree has no row
        counts[first, second] += 1
    return counts


def _chi2_p(counts: np.ndarray, expected: np.ndarray) -> float:
    keep = expected.flatten() * counts.sum() >= 5
    obs = counts.flatten()
    exp = expected.flatten() * counts.sum()
    obs = np.append(obs[keep], obs[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_point_mass_rejection_sampling_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(6, 5, generator=gen), dim=-1)
    tree = _two_level_tree()
    counts = _run_two_token(accept_sampled, probs, tree, 6000, seed=1)
    assert _chi2_p(counts, _exact_two_token_distribution(probs, tree)) > 1e-3


def test_point_mass_rule_fails_the_check_when_acceptance_is_broken():
    """The chi-square check has power: accepting the first candidate always is detected."""
    def accept_first(children, tokens, probs, generator):
        r = accept_greedy(children, tokens, [tokens[children[i][0]] if children[i] else 0
                                             for i in range(len(children))])
        return r
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(6, 5, generator=gen), dim=-1)
    tree = _two_level_tree()
    counts = _run_two_token(accept_first, probs, tree, 2000, seed=1)
    assert _chi2_p(counts, _exact_two_token_distribution(probs, tree)) < 1e-6


def test_draft_distribution_rejection_sampling_keeps_the_target_distribution():
    """SpecInfer's rule with children sampled i.i.d. from q (so candidates may repeat)."""
    gen = torch.Generator().manual_seed(4)
    V = 5
    p = torch.softmax(2 * torch.randn(4, V, generator=gen), dim=-1)  # rows: root, 3 children
    q = torch.softmax(2 * torch.randn(4, V, generator=gen), dim=-1)
    counts = np.zeros(V)
    for _ in range(6000):
        kids = torch.multinomial(q[0], 3, replacement=True, generator=gen).tolist()
        tree = DraftTree(kids, [-1, -1, -1], [1.0] * 3)
        r = accept_sampled_from_draft(tree.children(), tree.tokens, p, q, gen)
        counts[r.tokens[0]] += 1
    assert chisquare(counts, p[0].numpy() * counts.sum()).pvalue > 1e-3


# ----------------------------------------------------------------------------------- drafters
def test_ngram_drafter_branches_on_different_matches():
    # "1 2" was followed by 3 4 (twice) and by 5 6 (once, most recently): two branches.
    ctx = [1, 2, 3, 4, 0, 1, 2, 3, 4, 9, 1, 2, 5, 6, 8, 1, 2]
    tree = NgramDrafter(max_n=2, min_n=2).propose([ctx], TreeShape((2, 1)))[0]
    assert tree.tokens == [3, 5, 4, 6] and tree.parents == [-1, -1, 0, 1]
    assert tree.scores == pytest.approx([2 / 3, 1 / 3, 2 / 3, 1 / 3])
    chain = NgramDrafter(max_n=2, min_n=2).propose([ctx], TreeShape((1, 1, 1)))[0]
    assert chain.tokens == [3, 4, 9]  # the majority branch, continued by its most recent match
    assert NgramDrafter().propose([[1, 2, 3, 4]], TreeShape((1, 1)))[0].tokens == []  # no match


def test_ngram_drafter_matches_the_requests_own_output_not_only_its_prompt():
    # The prompt never repeats; the output has generated "7 8 9" once and now ends in "7 8".
    request = Request("r", prompt=[1, 2, 3, 4, 5], params=SamplingParams(), arrival=0.0)
    request.output = [7, 8, 9, 6, 7, 8]
    tree = NgramDrafter(max_n=2, min_n=2).propose([request.context], TreeShape((1, 1)))[0]
    assert tree.tokens == [9, 6]


# ----------------------------------------------------------------------------------- counting
def test_acceptance_counts_follow_the_controller_convention():
    counts = AcceptanceCounts((2, 2))
    tree = DraftTree([7, 8, 9, 3], [-1, -1, 1, 1], [1] * 4)
    counts.add(tree, accept_greedy(tree.children(), tree.tokens, [8, 0, 3, 0, 4]))  # ranks 1, 1
    counts.add(DraftTree(), accept_greedy([[]], [], [5]))  # no draft: rejected at depth 1
    assert counts.num_drafts == 1
    assert counts.reached == [[2, 2], [1, 1]] and counts.accepted == [[0, 1], [0, 1]]
    assert counts.drafted_per_pos == [1, 1] and counts.accepted_per_pos == [1, 1]


def test_budgeted_expansion_gives_the_tree_of_expanding_everything_then_pruning():
    draft = build_model(tiny_args(vocab_size=48), seed=3, init_std=0.2)
    contexts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    shape = TreeShape(widths=(4, 2, 2, 1, 1, 1), budget=5)
    full = DraftModelDrafter(draft, 2, 64).propose(contexts, TreeShape(widths=shape.widths))
    budgeted = DraftModelDrafter(draft, 2, 64).propose(contexts, shape)
    for whole, got in zip(full, budgeted):
        want = prune_best_first(whole, 5)
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
        assert got.scores == pytest.approx(want.scores)
        assert len(got) == 5 and len(whole) == 4 + 8 + 16 * 4
