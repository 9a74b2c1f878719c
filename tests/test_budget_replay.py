"""The budget replay (bench/budget_replay.py): acceptance read off a fixed output, the clock's
fit, and a replay that steps as the engine does (same nodes and acceptance at every step as a
real engine on a tiny random model, greedy)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from adaspec import step_cost
from adaspec.policy import SpecPolicy
from bench.budget_replay import accept_along, fitted_clock, replay
from bench.native_budget import redrawn
from native_engine.drafters import NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.model import build_model
from native_engine.requests import SamplingParams
from native_engine.testing import tiny_args
from native_engine.tree import DraftTree
from native_engine.verify import accept_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_acceptance_follows_the_output_and_adds_its_next_token():
    tree = DraftTree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 1, 3])  # 5 -> 7; 6 -> 8 -> 9
    result = accept_along(tree, [6, 8, 9, 3, 4])
    assert result.path == [0, 2, 4, 5] and result.tokens == [6, 8, 9, 3] and result.ranks == [1, 0, 0]
    assert accept_along(tree, [6, 8]).tokens == [6, 8]  # the output ends on an accepted node: no bonus
    assert accept_along(tree, [1, 5]).tokens == [1] and accept_along(tree, [1, 5]).path == [0]


def test_acceptance_is_the_greedy_rule_when_the_output_is_the_targets_argmax():
    rng = random.Random(0)
    for _ in range(200):
        tree = DraftTree()
        for i in range(rng.randrange(0, 12)):
            tree.tokens.append(rng.randrange(4))
            tree.parents.append(rng.randrange(-1, i))
        future = [rng.randrange(4) for _ in range(14)]
        # The target's argmax at every verify row: the output's next token on the output's path
        # (rows off it get any token; the greedy rule never reads them).
        result = accept_along(tree, future)
        argmax = [rng.randrange(4) for _ in range(len(tree) + 1)]
        for depth, row in enumerate(result.path):
            argmax[row] = future[depth]
        assert accept_greedy(tree.children(), tree.tokens, argmax).tokens == result.tokens


def test_the_clock_reproduces_passes_that_follow_the_step_cost_model():
    rng = random.Random(1)
    truth = step_cost.coefficients(fixed=0.004, seqs=0.0011, tokens=0.0006, tokens_over_32=0.0002, padded_tokens=0.0001,
                                   context_per_1000=0.0015, any_draft=0.003)
    passes = []
    for _ in range(400):
        seqs = rng.randrange(1, 9)
        tokens = seqs + rng.choice([0, 0, rng.randrange(1, 40)])
        padded = seqs * (1 + rng.randrange(0, tokens - seqs + 1))
        context = seqs * rng.randrange(20, 600)
        passes.append((float(step_cost.features(seqs, tokens, padded, context) @ truth), seqs, tokens, padded, context))
    clock = fitted_clock(passes)
    assert max(abs(clock.seconds(*p[1:], verify_only=True) - p[0]) for p in passes) < 2e-4  # the prior's pull
    assert clock.seconds(4, 4, 4, 1200, verify_only=True) < clock.seconds(4, 5, 8, 1200, verify_only=True)


@pytest.mark.parametrize("policy", ["off", "chain4", "tree2x2x1x1"])
def test_a_replay_steps_as_the_engine_does(policy):
    """Greedy outputs are the target's under every policy: replayed over them, a static
    policy verifies the same nodes and accepts the same tokens, step by step, as the engine."""
    target = build_model(tiny_args(vocab_size=64, head_dim=8), seed=1, init_std=0.15)  # repeats itself
    engine = NativeEngine(target, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=3, max_seq_len=256),
                          SpecPolicy.parse(policy))
    gen = torch.Generator().manual_seed(0)
    requests = [{"id": f"r{i}", "ids": torch.randint(0, 64, (10,), generator=gen).tolist(),
                 "params": SamplingParams(max_tokens=20 + 3 * i)} for i in range(5)]
    outputs = {r["id"]: [] for r in requests}
    for r in requests:
        engine.add_request(r["id"], r["ids"], r["params"])
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    real = [(s.nodes_per_seq, s.accepted_per_seq) for s in engine.drain().steps if s.num_decode_reqs]
    clock = fitted_clock([(0.01 + 0.001 * t, n, t, n * 4, 100 * n) for n in (1, 2, 3) for t in range(n, n + 9)])
    fresh = NativeEngine(target, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=3, max_seq_len=256),
                         SpecPolicy.parse(policy))
    replayed = replay(fresh, requests, outputs, clock)["steps"]
    assert [nodes for nodes, _, _ in replayed] == [nodes for nodes, _ in real]
    # Where a sequence's last tokens are accepted the engine may count drafts past its end (cut
    # from its output); the replay knows the output only as far as it goes.
    assert [[min(a, left) for a, left in zip(accepted, lefts)] for (_, accepted), (_, _, lefts) in zip(real, replayed)
            ] == [accepted for _, accepted, _ in replayed]
    assert policy == "off" or sum(a for _, accepted in real for a in accepted) > 0  # the drafts did get accepted


def test_each_round_draws_the_sampled_outputs_afresh():
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3)
    requests = [{"id": "a", "ids": [1, 2], "params": params}]
    assert redrawn(requests, 0) == requests
    moved = redrawn(requests, 2)[0]["params"]
    assert moved.seed != params.seed and moved == dataclasses.replace(params, seed=moved.seed)
    assert requests[0]["params"].seed == 3  # the set itself is left as it was
