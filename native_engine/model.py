"""Llama-family decoder in plain torch: Llama, SmolLM2, Mistral, Qwen2 (QKV bias).

Modules carry Hugging Face's parameter names (`model.layers.3.self_attn.q_proj.weight`), so a
safetensors folder loads with `load_state_dict` and an HF model's state dict copies across
for cross-checks. Everything that varies per step is a `forward` argument (gpt-fast style):
token ids, RoPE positions, the attention mask, and where the new keys/values go in the cache.
That is what lets one pass verify a whole token tree: the tree's nodes share a RoPE position
per depth, and the mask lets each node see only the prefix and its own ancestors.

The model only: its attention's dispatch is native_engine/attention.py, a CPU model's matmuls
native_engine/cpu_linear.py (`prepare_for_serving`), the compiled decode pass
native_engine/compiled_decode.py.

Shapes: B = sequences in the batch, T = new tokens per sequence (padded), S = key length
(cache positions attended to), V = vocab, D = hidden size, H / Hkv = query / key-value heads,
Dh = head dim.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from native_engine import decode_attention
from native_engine.attention import (ForwardInputs, Packing, cached_attention, cached_attention_op, in_progress,
                                     prefix_lengths, whole_key_blocks)
from native_engine.cpu_linear import use_cpu_linears
from native_engine.kv_cache import KVCache
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
        cache, its write positions and the mask come from the forward in progress (`ForwardInputs`,
        native_engine/attention.py)."""
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
        attention = cached_attention_op if torch.compiler.is_compiling() else cached_attention
        out = attention(q, k, v, self.layer)  # [B, T, H * Dh]
        if packed is not None:
            out = packed.pack(out)
        return self.o_proj(out)


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


# Compiled (native_engine/compiled_decode.py), a batch-1 pass of up to this many tokens runs the
# compiled graph: verify passes of chains and trees (a tree of 63 nodes), short prefills.
COMPILED_TOKENS_AT_BATCH_1 = 64


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
        self.compiled_decode = None  # `decoder` compiled for one token per row (native_engine/compiled_decode.py)
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
        in_progress.inputs = ForwardInputs(mask, cache, row_start, write_pos, key_len, one_token_keys,
                                           prompt_lengths, tree_keys)
        try:
            if self.compiled_decode is not None and packed is None and (
                    tokens.shape[1] == 1 or (tokens.shape[0] == 1 and tokens.shape[1] <= COMPILED_TOKENS_AT_BATCH_1)):
                return self.compiled_decode(tokens, cos, sin)
            return self.decoder(tokens, cos, sin, packed)
        finally:
            in_progress.inputs = None

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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [..., V] of hidden states [..., D]."""
        return self.lm_head(hidden).float()

    def prepare_for_serving(self) -> Transformer:
        """Rearrange the weights for fast decoding; the outputs stay the same. Returns self.

        - Each layer's q/k/v and gate/up projections become one matmul each (as vLLM's
          QKVParallelLinear and MergedColumnParallelLinear): 4 matmuls per layer instead of 7.
          At small batch every call pays a dispatch and a thread-pool wake-up on a CPU (a
          kernel launch on a GPU), and a wider matrix streams at a better rate.
        - On a CPU, every matmul becomes a `CpuLinear`, which runs each pass on the matmul path
          (input-major GEMV, MKL on the [out, in] layout, oneDNN prepacked) that was fastest
          for its number of rows, measured here or read from the last measurement on this
          machine (native_engine/cpu_linear.py, linear_choice.py; `linear_choice`). The
          winners move: the input-major one streamed the lm_head 2x faster than [out, in] at
          one token on one day (4.3 vs 9.2 ms, one thread), the packed one won at one token by
          15% on another, and at 2-3 tokens [out, in] beat both by 15% in float32
          (docs/native-engine.md).
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
            use_cpu_linears(self)
        self.uses_decode_kernel()  # builds it now rather than at the first decode step
        self.serving = True
        return self


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
