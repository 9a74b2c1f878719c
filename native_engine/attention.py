"""What a layer's attention reads and how it runs: the forward's inputs, the dispatch, the op.

`Transformer.forward` (native_engine/model.py) sets one `ForwardInputs` per forward on
`in_progress`, a thread-local; each layer's `Attention` then calls `cached_attention`, which
writes the layer's new keys and values to the cache and attends over it by one of three routes:
a prefill prompt by prompt (`prompt_attention`), the decode-attention kernels
(native_engine/decode_attention.py) for decode steps and verify passes over a float32 cache,
else torch's attention (`attend`). Traced by torch.compile it is one opaque op
(`cached_attention_op`). Also here: the masks (`causal_mask`, `whole_key_blocks`,
`prefix_lengths`) and `Packing`, the layout of a pass whose rows are of uneven length.

Shapes as in native_engine/model.py: B sequences, T new tokens per sequence, S keys, H / Hkv
query / key-value heads, Dh head dim.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from native_engine import decode_attention
from native_engine.kv_cache import KVCache, whole_key_blocks_of


@dataclass(frozen=True)
class ForwardInputs:
    """What every layer's attention reads in one forward, set by `Transformer.forward`.

    mask [B, 1, T, S] additive (0 = attend, -inf = not) in the model's dtype, or None when every
    query attends every key.
    cache, row_start, write_pos [B, T], key_len: the new keys/values go to cache positions
    `write_pos` of rows row_start .. row_start + B - 1; attention reads positions [0, key_len).
    Without a cache, the tokens attend among themselves (S = T).
    one_token_keys [B] int64: set when a one-token pass runs the decode-attention kernel
    (native_engine/decode_attention.py): how many cache positions each row's token attends,
    a prefix of its row (`prefix_lengths`).
    tree_keys: (counts [B] int64, allowed [B, T, S] bool) set when any other pass over a cache
    runs the decode-attention kernels (the tree kernel): a verify pass. Either way a layer's
    cache write and attention are one call (`decode_attention.write_and_attend`).
    prompt_lengths: set for a prefill (`prompt_attention`): the pass's tokens [1, N] are
    prompts of these lengths one after another, for cache rows row_start.. at positions 0..;
    mask and write_pos are then unused."""

    mask: torch.Tensor | None
    cache: KVCache | None
    row_start: int
    write_pos: torch.Tensor | None
    key_len: int
    one_token_keys: torch.Tensor | None = None
    prompt_lengths: tuple[int, ...] | None = None
    tree_keys: tuple[torch.Tensor, torch.Tensor] | None = None



in_progress = threading.local()  # .inputs: the ForwardInputs of the forward running on this thread


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Write k, v [B, T, Hkv, Dh] to the cache of the forward in progress, then attention of
    the (rotated) queries q [B, T, H, Dh] over its keys. Returns [B, T, H * Dh]."""
    s: ForwardInputs = in_progress.inputs
    if s.prompt_lengths is not None:
        return prompt_attention(q, k, v, layer, s)
    if s.one_token_keys is not None or s.tree_keys is not None:  # the kernels, over a cache
        counts, allowed = s.tree_keys or (s.one_token_keys, None)
        return decode_attention.write_and_attend(q, k, v, s.cache, layer, s.row_start, s.write_pos, counts, allowed)
    if s.cache is None:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, Dh]
    else:
        keys, values = s.cache.update(layer, s.row_start, s.write_pos, k, v, s.key_len)  # [B, Hkv, S, Dh]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bfloat16 model's float32 cache
    B, T, H, Dh = q.shape
    return attend(q.transpose(1, 2), keys, values, s.mask).transpose(1, 2).reshape(B, T, H * Dh)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, s: ForwardInputs
                     ) -> torch.Tensor:
    """A prefill's attention: q, k, v [1, N, heads, Dh], the prompts' tokens one after another;
    each prompt's go to its cache row and attend causally among themselves. Returns [1, N, H * Dh].

    Prompt by prompt with `is_causal` rather than the prompts padded to one length under a mask:
    no work on pad tokens (RoPE, cache writes, attention), and torch's kernel skips the key
    blocks past the diagonal. A prompt's attention is then the same computation whichever
    prompts share its pass. (2026-12-05, AMD EPYC, 16 HumanEval prompts of 1,634 tokens: the
    prefill 1.03-1.07x faster, 4 prompts 1.09-1.12x; docs/native-engine.md, "Prefill".)"""
    _, N, H, Dh = q.shape
    s.cache.write_prompts(layer, s.row_start, s.prompt_lengths, k, v)
    out = q.new_empty(1, N, H, Dh)
    start = 0
    for b, n in enumerate(s.prompt_lengths):
        # What was just written: [1, Hkv, n, Dh] (a bfloat16 model's float32 cache narrowed back, exactly).
        keys = s.cache.k[layer, s.row_start + b, None, :, :n].to(q.dtype)
        values = s.cache.v[layer, s.row_start + b, None, :, :n].to(q.dtype)
        out[:, start:start + n] = F.scaled_dot_product_attention(
            q[:, start:start + n].transpose(1, 2), keys, values, is_causal=True,
            enable_gqa=H > keys.shape[1]).transpose(1, 2)
        start += n
    return out.view(1, N, H * Dh)


# How vLLM compiles a model around its attention (its unified_attention op reads a forward
# context the same way): the op takes the step's new tokens only, and reads the cache, mask and
# key length from `in_progress`, so those neither enter the graph nor cause recompiles. It writes
# the cache without declaring it: its output feeds the next layer, so nothing reorders or drops it.
# Defined on a torch.library.Library rather than with torch.library.custom_op: a call of the
# latter's wrapper cost 19 us against 5 here (ad hoc, 2026-12-05), 30 calls a step.
_library = torch.library.Library("adaspec", "FRAGMENT")
_library.define("cached_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_library.impl("cached_attention", cached_attention, "CompositeExplicitAutograd")
cached_attention_op = torch.ops.adaspec.cached_attention


@torch.library.register_fake("adaspec::cached_attention")
def _(q, k, v, layer):
    B, T, H, Dh = q.shape
    return q.new_empty(B, T, H * Dh)


def prefix_lengths(mask: torch.Tensor | None, key_len: int, rows: int) -> torch.Tensor | None:
    """For a one-token pass: how many keys each row attends [rows] int64, where its mask row
    [B, 1, 1, S] (bool True = attend, or additive 0 = attend; None = all `key_len`) is a
    prefix 0 .. n - 1 with n >= 1, as in causal decoding: the decode-attention kernel's case.
    None where some row's is not (a draft tree's node attends its ancestors, not the siblings
    written between them), and attention stays torch's with the mask."""
    if mask is None:
        return torch.full((rows,), key_len, dtype=torch.long)
    seen = (mask if mask.dtype == torch.bool else mask == 0).reshape(rows, -1)
    n = seen.sum(-1)
    prefix = torch.arange(seen.shape[1], device=seen.device)[None, :] < n[:, None]
    return n if bool((n > 0).all() and (seen == prefix).all()) else None


def whole_key_blocks(mask: torch.Tensor | None, key_len: int, device=None) -> tuple[torch.Tensor | None, int]:
    """(mask, key length) of a pass whose attention reads keys up to the next multiple of
    kv_cache.KEY_BLOCK, the keys past `key_len` masked out.

    torch's CPU attention kernel sums a query's keys in blocks of 16; a block that ends early
    is summed another way than a full one holding masked keys. So in bfloat16 the same query
    over the same keys got other bits from a one-token pass (S keys) than from a verify pass
    or a batch (more keys, the extra ones masked), and greedy output under speculation or at
    another batch size drifted from `off`'s at batch 1. With every pass reading whole blocks,
    masked keys and whole masked blocks change no bits (checked at 1-2,200 keys, 1-15 query
    rows; docs/native-engine.md). Float32 passes stay as they are: there the kernel's result
    depends on more than the block (from about 300 keys), and greedy output agrees anyway."""
    padded = whole_key_blocks_of(key_len)
    if padded == key_len:
        return mask, key_len
    if mask is None:  # every row attends every key: one mask row for all
        return (torch.arange(padded, device=device) < key_len).view(1, 1, 1, padded), padded
    return F.pad(mask, (0, padded - key_len), value=False), padded


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, H, T, Dh] over keys/values [B, Hkv, S, Dh] (grouped-query when
    Hkv < H); mask [B, 1, T, S] bool (True = attend), additive, or None. Returns [B, H, T, Dh].

    With grouped queries the H / Hkv query heads of a group read the same keys, so they are
    folded into one head's query rows ([B, Hkv, G * T, Dh], the mask repeated per head): the
    same numbers, and torch's CPU flash kernel runs them as one block. In bfloat16 a
    single-query row takes that kernel's slow path: folded, a decode step's attention is 4-8x
    faster, and a tree's 1.1-1.5x (docs/benchmarks.md at 1dcc68e, "Where the step's time goes"). Single
    float32 queries are as fast or faster unfolded, so they stay so."""
    B, H, T, Dh = q.shape
    G = H // keys.shape[1]
    if G == 1 or (T == 1 and q.dtype == torch.float32):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=G > 1)
    if mask is not None:
        mask = mask[:, :, None].expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
    out = F.scaled_dot_product_attention(q.reshape(B, H // G, G * T, Dh), keys, values, attn_mask=mask)
    return out.view(B, H, T, Dh)


@dataclass(frozen=True)
class Packing:
    """Rows of uneven length run packed: the token-wise layers (projections, MLP, norms) see
    only the N real tokens [1, N, ...]; attention sees them back in their padded rows
    [B, T, ...], so pad tokens cost no matmul work (a batch of uneven token trees)."""

    real: torch.Tensor  # [N] indices of the real tokens in the flattened [B * T] layout
    batch: int  # B
    length: int  # T

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, N, ...]"""
        return x.reshape(self.batch * self.length, *x.shape[2:])[self.real][None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [B, T, ...], zeros at the pad positions."""
        out = x.new_zeros(self.batch * self.length, *x.shape[2:])
        out[self.real] = x[0]
        return out.view(self.batch, self.length, *x.shape[2:])


def causal_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, 1, T, T] causal mask for right-padded rows of `lengths` real tokens (pads see themselves)."""
    idx = torch.arange(T, device=lengths.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    real = idx[None, :] < lengths[:, None]  # [B, T] keys that are real tokens
    return ((causal[None] & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=lengths.device))[:, None]
