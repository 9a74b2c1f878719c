"""Sampling with tree speculation keeps the target's output distribution exactly.

Thousands of 3-token completions of one prompt on a tiny model (vocab 8), through the whole
engine (continuous batching, draft trees, stochastic acceptance), are compared with the
exact joint distribution P(t1, t2, t3 | prompt) of the target by a chi-square test. The
first token comes from prefill; the next two pass through tree verification. The same check
with acceptance deliberately broken (every first-ranked draft accepted) must fail.
Per-request budgets (`auto`, `budget8`) run with greedy companion requests in the same
batches, so one verify pass holds uneven trees: many nodes for the greedy ones, few or none
for the sampled ones. Their node budget is fixed (`fixed_budget`): the engine's own choice
follows the measured step time, which on a loaded machine can price out nearly every node and
leave too few drafts for the test to mean anything; which nodes are kept, the calibration and
the uneven verification are the engine's own.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import native_engine.budget as budget_module
import native_engine.engine as engine_module
from adaspec.policy import SpecPolicy
from native_engine.drafters import DraftModelDrafter, NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.model import build_model
from native_engine.requests import SamplingParams
from native_engine.testing import full_logits, noisy_copy, tiny_args
from native_engine.verify import Acceptance, probs_from_logits, sample_index

V = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so n-gram lookup proposes drafts too
SAMPLES = 3000


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return build_model(tiny_args(vocab_size=V), seed=11, init_std=0.4)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, 0.5, seed=12)


def _exact_joint(model, temperature: float, top_p: float) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT) [V, V, V] by enumerating every prefix."""
    joint = np.zeros((V, V, V))
    p1 = probs_from_logits(full_logits(model, PROMPT)[-1], temperature, top_p)
    for a in range(V):
        p2 = probs_from_logits(full_logits(model, PROMPT + [a])[-1], temperature, top_p)
        for b in range(V):
            p3 = probs_from_logits(full_logits(model, PROMPT + [a, b])[-1], temperature, top_p)
            joint[a, b] = float(p1[a]) * float(p2[b]) * p3.double().numpy()
    return joint


COMPANION = [4, 5, 6, 4, 5, 6, 4, 5]


@pytest.fixture
def fixed_budget(monkeypatch):
    """Every budgeted step drafts and keeps the batch's 2 x sequences most likely nodes (capped
    by `budgetN` and the offers), whatever the step-cost fit and the drafting time say:
    deterministic for a seed."""
    monkeypatch.setattr(budget_module.BudgetPlanner, "should_draft", lambda self, seqs, context_tokens: True)
    monkeypatch.setattr(budget_module, "best_selection",
                        lambda ranked, seqs, step_seconds, max_nodes=None: ranked[: min(
                            len(ranked) if max_nodes is None else max_nodes, 2 * seqs)])


def _sample(engine: NativeEngine, temperature: float, top_p: float, companions: bool = False) -> np.ndarray:
    """Counts of the sampled completions; with `companions`, every fourth request is a greedy
    one on another prompt (not counted), so trees differ within a batch."""
    counts = np.zeros((V, V, V))
    params = SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i in range(SAMPLES):
        engine.add_request(str(i), PROMPT, params)
        if companions and i % 4 == 0:
            engine.add_request(f"c{i}", COMPANION, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid, toks in outputs.items():
        if not rid.startswith("c"):
            counts[tuple(toks)] += 1
    return counts


def _p_value(counts: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square p-value; cells expecting fewer than 5 samples are pooled into one."""
    n = counts.sum()
    exp, obs = joint.flatten() * n, counts.flatten()
    small = exp < 5
    if exp[small].sum() < 1e-9:  # top_p made those cells impossible: none may occur
        if obs[small].sum() > 0:
            return 0.0
        exp, obs = exp[~small], obs[~small]
    else:
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    return float(chisquare(obs, exp * n / exp.sum()).pvalue)


def _engine(target, draft, drafter: str, shape: str) -> NativeEngine:
    d = DraftModelDrafter(draft, 32, 64) if drafter == "draft_model" else NgramDrafter(max_n=2, min_n=1)
    return NativeEngine(target, d, EngineConfig(max_batch_size=32, max_seq_len=40, max_tree_nodes=20, seed=7),
                        SpecPolicy.parse(shape))


@pytest.mark.parametrize("drafter,shape,temperature,top_p", [
    ("draft_model", "tree3x2", 1.0, 1.0),
    ("ngram", "tree2x2x1", 1.0, 1.0),
    ("draft_model", "chain2", 0.7, 0.9),
    ("draft_model", "auto", 1.0, 1.0),
    ("ngram", "budget8", 0.7, 0.9),
])
def test_speculative_sampling_matches_the_target_distribution(target, draft, drafter, shape, temperature, top_p,
                                                              request):
    budgets = shape in ("auto", "budget8")
    if budgets:
        request.getfixturevalue("fixed_budget")
    engine = _engine(target, draft, drafter, shape)
    counts = _sample(engine, temperature, top_p, companions=budgets)
    steps = engine.drain().steps
    accepted = sum(sum(s.accepted_per_pos) for s in steps)
    assert accepted > SAMPLES / 10, f"too few accepted drafts ({accepted}) for the test to mean anything"
    if budgets:  # uneven trees in one pass: at least one step verified different node counts
        assert any(len({n for n in s.nodes_per_seq}) > 2 for s in steps)
    assert _p_value(counts, _exact_joint(target, temperature, top_p)) > 1e-3


@pytest.mark.parametrize("shape", ["tree3x2", "auto"])
def test_the_check_fails_when_every_draft_is_accepted(target, draft, monkeypatch, shape, request):
    """Negative control: accepting rank-0 children unconditionally changes the distribution."""
    if shape == "auto":
        request.getfixturevalue("fixed_budget")
    def accept_everything(children, tokens, probs, generator):
        out, row = Acceptance(path=[0]), 0
        while children[row]:
            node = children[row][0]
            out.ranks.append(0)
            out.tokens.append(tokens[node])
            row = node + 1
            out.path.append(row)
        out.tokens.append(int(torch.multinomial(probs[row].double(), 1, generator=generator)))
        return out

    monkeypatch.setattr(engine_module, "accept_sampled", accept_everything)
    counts = _sample(_engine(target, draft, "draft_model", shape), 1.0, 1.0, companions=shape == "auto")
    assert _p_value(counts, _exact_joint(target, 1.0, 1.0)) < 1e-6


def test_sample_index_draws_the_weights_distribution():
    """The inverse-CDF draw every sampled token takes: frequencies match the weights (chi-square),
    zero weights never come up (the first, the last, and one between two others included), and a
    wrong draw (the weights shifted by one index) fails the same check."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0], dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    draws = [sample_index(weights, gen) for _ in range(20000)]
    counts = np.bincount(draws, minlength=len(weights))
    assert counts[weights.numpy() == 0].sum() == 0
    expected = weights.numpy() / weights.sum().item()
    assert _p_value(counts[None].astype(float), expected[None]) > 1e-3
    shifted = np.roll(counts, 1)
    assert _p_value(shifted[None].astype(float), expected[None]) < 1e-6


def test_exact_joint_is_a_distribution(target):
    joint = _exact_joint(target, 1.0, 1.0)
    assert joint.sum() == pytest.approx(1.0, abs=1e-5)
    assert max(joint[a, b].max() for a, b in itertools.product(range(V), range(V))) < 0.9  # not degenerate
