"""The native engine on a CUDA device (skipped without one; `scripts/gpu-check.sh` runs it on
a GPU machine): in float32 every speculation shape's greedy output equals the target's own
greedy decoding on the same device, with requests joining and leaving; in bfloat16 (where a
tree pass and a recomputation round differently) the outputs agree on most tokens and
sampled requests under per-request budgets finish."""

from __future__ import annotations

import copy

import pytest
import torch

from native_engine.requests import SamplingParams
from native_engine.testing import reference_greedy
from testkit.tiny_engine import SHAPES, engine_for, make_draft, make_prompts, make_target, run_mixed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MAX_TOKENS = [30, 12, 25, 30, 7, 20]
JOIN_AT = [0, 0, 1, 3, 4, 9]


@pytest.fixture(scope="module")
def on_cuda():
    target = make_target()
    draft = make_draft(target)
    # Module.to moves in place: a copy per dtype.
    return {dtype: (copy.deepcopy(target).to("cuda", dtype), copy.deepcopy(draft).to("cuda", dtype))
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_greedy_equals_the_targets_own_decoding(on_cuda, prompts, drafter, shape):
    target, draft = on_cuda[torch.float32]
    outputs, reasons = run_mixed(engine_for(target, draft, drafter, shape), prompts, MAX_TOKENS, JOIN_AT, abort={})
    for i, prompt in enumerate(prompts):
        assert reasons[i] == "length"
        assert outputs[i] == reference_greedy(target, prompt, MAX_TOKENS[i]), (shape, i)


@pytest.mark.parametrize("shape", ["chain4", "tree3x3x2@10", "auto"])
def test_bfloat16_runs_every_shape_and_mostly_agrees(on_cuda, prompts, shape):
    target, draft = on_cuda[torch.bfloat16]
    outputs, _ = run_mixed(engine_for(target, draft, "draft_model", shape), prompts, MAX_TOKENS, JOIN_AT, abort={})
    same = total = 0
    for i, prompt in enumerate(prompts):
        ref = reference_greedy(target, prompt, MAX_TOKENS[i])
        # Count up to the first difference: after it the two continue different texts.
        agree = next((j for j, (a, b) in enumerate(zip(outputs[i], ref)) if a != b), len(ref))
        same, total = same + agree, total + len(ref)
    assert same >= 0.8 * total, (same, total)

    engine = engine_for(target, draft, "draft_model", "auto")
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True, seed=i))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert sorted(len(v) for v in done.values()) == [20] * len(prompts)
