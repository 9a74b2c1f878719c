"""Reference decoding and small fixtures for tests and benchmarks (no engine involved).

- `reference_greedy`: the target's own greedy decoding, one full forward per token with no
  KV cache, no batching and no speculation: what every engine configuration must reproduce.
- `tiny_args` / `noisy_copy`: random-weight models small enough for CPU tests; a noisy copy
  of the target is a draft model that agrees with it often but not always.
- `CharTokenizer`: the two methods the engine calls on a tokenizer, for stop-string tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from native_engine.attention import causal_mask
from native_engine.model import ModelArgs, Transformer


def tiny_args(vocab_size: int = 64, **overrides) -> ModelArgs:
    """A 2-layer GQA model (4 query heads, 2 KV heads) with a few thousand parameters; its head
    size (16) is one the decode-attention kernel takes, so engine tests run it."""
    base = dict(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                intermediate_size=64, rope_theta=10000.0, max_position=512)
    base.update(overrides)
    return ModelArgs(**base)


@torch.no_grad()
def full_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Float32 logits [len(tokens), V] from one cache-free forward over `tokens`."""
    t = torch.tensor([tokens], device=model.lm_head.weight.device)
    T = len(tokens)
    pos = torch.arange(T, device=t.device)[None]
    hidden = model(t, pos, causal_mask(torch.tensor([T], device=t.device), T))
    return model.logits(hidden[0])


@torch.no_grad()
def reference_greedy(model: Transformer, prompt: list[int], max_tokens: int,
                     eos_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy decoding by recomputing the whole sequence for every token (no cache)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tok = int(full_logits(model, tokens)[-1].argmax())
        tokens.append(tok)
        if tok in eos_ids:
            break
    return tokens[len(prompt):]


@torch.no_grad()
def noisy_copy(model: Transformer, scale: float, seed: int = 0) -> Transformer:
    """A copy of `model` with Gaussian noise (std = scale * each tensor's std) on every weight."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    for p in out.parameters():
        p.add_(scale * p.float().std() * torch.randn(p.shape, generator=gen).to(p.dtype))
    return out


@dataclass
class CharTokenizer:
    """Token i <-> the character chr(ord('a') + i % 26); enough for stop-string tests."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def encode(self, text: str):
        @dataclass
        class _Encoding:
            ids: list[int]

        return _Encoding([ord(c) - ord("a") for c in text])
