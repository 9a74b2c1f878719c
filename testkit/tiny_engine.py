"""A tiny random target model, a draft that agrees with it often, prompts, and the native
engine over them: what the native engine's tests on CPU and on CUDA share (no real model)."""

from __future__ import annotations

import torch

from adaspec.policy import SpecPolicy
from native_engine.drafters import DraftModelDrafter, NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.model import build_model
from native_engine.requests import SamplingParams
from native_engine.testing import noisy_copy, tiny_args

SHAPES = ["off", "chain1", "chain4", "tree2x2", "tree4x2x2x1", "tree3x3x2@10",  # @N: best-first budget
          "auto", "budget6"]  # per-request budgets: uneven trees in one verify pass


def make_target():
    # init_std 0.15 makes a random model repeat itself, so n-gram drafts get accepted.
    return build_model(tiny_args(vocab_size=64), seed=1, init_std=0.15)


def make_draft(target):
    return noisy_copy(target, 0.1, seed=2)  # agrees with the target often, not always


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 11, 3, 8, 17, 6)]


def engine_for(target, draft, drafter: str, shape: str, max_batch: int = 3, **config) -> NativeEngine:
    """The engine with `drafter` ("ngram" or "draft_model") under policy `shape` (a SHAPES
    entry: `name@N` is `name` with a best-first tree budget of N nodes)."""
    name, _, budget = shape.partition("@")
    cfg = EngineConfig(max_batch_size=max_batch, max_seq_len=192, tree_budget=int(budget) if budget else None,
                       **config)
    d = NgramDrafter(max_n=3, min_n=1) if drafter == "ngram" else DraftModelDrafter(draft, max_batch, 192)
    return NativeEngine(target, d, cfg, SpecPolicy.parse(name))


def run_mixed(engine: NativeEngine, prompts, max_tokens: list[int], join_at: list[int], abort: dict[int, int]):
    """Requests join at the given steps and leave at max_tokens (or abort at a step)."""
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    reasons: dict[int, str] = {}
    step = 0
    while step < 200:
        for i, at in enumerate(join_at):
            if at == step:
                engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=max_tokens[i]))
        for i, at in abort.items():
            if at == step:
                assert engine.abort(str(i))
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
            if out.finished:
                reasons[int(out.request_id)] = out.finish_reason
        step += 1
        if step > max(join_at) and not engine.has_unfinished():
            break
    return outputs, reasons
