"""The decode-attention kernels (csrc/decode_attention.cpp), where they can run: float32
arithmetic over a float32 KV cache, for float32 models and bfloat16 ones (whose q, k and v
`write_and_attend` widens, and whose output it rounds back; `Transformer.cache_dtype`).

A decode step's attention (one new token per sequence over its KV cache) is the one part of
a batch-16 step that grows with the cache and not with the weights. torch's CPU attention
runs it as two small GEMMs and a masked softmax per (sequence, KV head); the kernel reads each
sequence's keys and values once, up to its own length instead of the batch's longest, with
the query heads that share a KV head side by side (docs/native-engine.md, "Decode attention").
A verify pass (a draft tree's tokens per sequence) runs the same loops under its tree mask
(`tree_attention`), each sequence over its own keys rather than the batch's longest. The
engine calls both through `write_and_attend`, which writes the pass's keys and values to the
cache first, in the same C++ call.

Built with adaspec's other CPU kernels (native_engine/cpu_kernels.py). Where it cannot run,
`kernel()` returns None and attention stays torch's: a CPU without AVX2 and FMA, no C++
compiler, head dims that are not a multiple of 16, another dtype.
"""

from __future__ import annotations

import torch

from native_engine import cpu_kernels


def kernel():
    """torch.ops.adaspec.decode_attention once built and loaded, or None where it cannot run here."""
    return torch.ops.adaspec.decode_attention if cpu_kernels.load() else None


def supports(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the kernel takes a model of this head size, dtype and device."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
                     ) -> torch.Tensor:
    """Attention of q [B, H, Dh] (one token per sequence) over keys/values [B, Hkv, S, Dh]
    (views of the cache, Dh contiguous), sequence b reading its first lengths[b] keys
    (int64 [B], 1..S). Query head i reads KV head i // (H / Hkv), as in grouped-query
    attention. Returns [B, H * Dh]; call only where `kernel()` is not None."""
    B, H, Dh = q.shape
    Hkv = keys.shape[1]
    out = kernel()(q.reshape(B, Hkv, H // Hkv, Dh).contiguous(), keys, values, lengths, Dh ** -0.5)
    return out.view(B, H * Dh)


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, T, H, Dh] (a verify pass: T tokens per sequence) over keys/values
    [B, Hkv, S, Dh] (views of the cache, Dh contiguous): sequence b's queries read its first
    counts[b] keys (int64 [B], 1..S), query t key s only where allowed[b, t, s] (bool
    [B, T, S], contiguous). Returns [B, T, H * Dh]; call only where `kernel()` is not None."""
    B, T, H, Dh = q.shape
    Hkv = keys.shape[1]
    grouped = q.reshape(B, T, Hkv, H // Hkv, Dh).transpose(1, 2).contiguous()  # [B, Hkv, T, G, Dh]
    out = torch.ops.adaspec.tree_attention(grouped, keys, values, counts, allowed, Dh ** -0.5)
    return out.transpose(1, 2).reshape(B, T, H * Dh)


def key_counts(allowed: torch.Tensor) -> torch.Tensor:
    """Per sequence, the keys its queries read: one past the last key any of its queries may
    attend (allowed [B, T, S] bool; at least 1). int64 [B]."""
    seen = allowed.any(1)  # [B, S]
    last = seen.shape[1] - 1 - seen.flip(-1).to(torch.uint8).argmax(-1)
    return torch.clamp(last + 1, min=1).to(torch.long)


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, layer: int, row_start: int,
                     write_pos: torch.Tensor, counts: torch.Tensor, allowed: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """A layer's attention in one kernel call: k, v [B, T, Hkv, Dh] (float32 or bfloat16, as q)
    written to `cache` (a float32 KVCache) at rows row_start.., positions write_pos [B, T]; then q [B, T, H, Dh]
    attends as `decode_attention` (no `allowed`, T = 1; counts: each sequence's keys) or as
    `tree_attention` (allowed [B, T, S]: a verify pass's mask; counts from `key_counts`).
    Returns [B, T, H * Dh]; call only where `kernel()` is not None."""
    return torch.ops.adaspec.write_and_attend(q, k, v, cache.k, cache.v, layer, row_start, write_pos, counts,
                                              allowed, q.shape[-1] ** -0.5)
