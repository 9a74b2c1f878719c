"""An EAGLE-3 draft head: the model, and its folder in the format vLLM loads (`method: eagle3`).

EAGLE-3 (Li et al. 2025) drafts from the target's own features: the residual stream entering
three target layers (a low, a middle and a high one) is concatenated and projected by `fc` to
the hidden size; one decoder layer reads that projection beside the embedding of the next
token and predicts the token after it over a reduced draft vocabulary. Later draft steps feed
the layer's own output back in place of the target's features.

This module mirrors vLLM 0.32's `model_executor/models/llama_eagle3.py` (Eagle3LlamaForCausalLM)
weight for weight, so a head trained here is served by vLLM unchanged:
- the layer's attention reads cat(input_layernorm(embedding), hidden_norm(hidden)) (2 x hidden
  wide); its residual is the hidden input before hidden_norm (vLLM's default,
  `norm_before_residual: false`);
- the output handed to the next draft step is the layer's output before the final norm;
- logits cover `draft_vocab_size` tokens; draft id i is target id i + d2t[i];
- the embedding is the target's (vLLM shares it when the folder has no `embed_tokens`).
The aux layer ids follow vLLM's `_maybe_add_hidden_state`: id n is the residual stream after
n target layers (Hugging Face's `hidden_states[n]`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from native_engine.model import MLP, ModelArgs, ModelLoadError, RMSNorm, apply_rope, rope_tables, signed_sin

WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's registry maps it to Eagle3LlamaForCausalLM


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """vLLM's default choice (`get_eagle3_default_aux_hidden_state_layers`)."""
    return (2, n_layers // 2, n_layers - 3)


@dataclass(frozen=True)
class Eagle3Args:
    target: ModelArgs  # the target's architecture: the head's layer has the same shape as one of its layers
    draft_vocab_size: int
    aux_layers: tuple[int, ...]

    @property
    def fc_in(self) -> int:
        return self.target.dim * len(self.aux_layers)

    def hf_config(self, target_config: dict) -> dict:
        """config.json for vLLM: a one-layer Llama config with EAGLE-3's fields."""
        a = self.target
        keep = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "rms_norm_eps",
                "rope_parameters", "rope_scaling", "rope_theta")
        cfg = {k: target_config[k] for k in keep if k in target_config}
        cfg.update({
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.intermediate_size,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "vocab_size": a.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": a.dim,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                             "use_aux_hidden_state": True},
        })
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Eagle3Args:
        if (cfg.get("architectures") or [None])[0] != ARCHITECTURE:
            raise ModelLoadError(f"not an EAGLE-3 head: architectures {cfg.get('architectures')}, "
                                 f"expected [{ARCHITECTURE!r}]")
        base = dict(cfg, architectures=["LlamaForCausalLM"])
        target = ModelArgs.from_hf_config(base)
        layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not layers:
            raise ModelLoadError("EAGLE-3 head config has no eagle_config.eagle_aux_hidden_state_layer_ids")
        return cls(target=target, draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                   aux_layers=tuple(int(x) for x in layers))


class Eagle3Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.q_proj = nn.Linear(2 * a.dim, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (`midlayer` in the checkpoint)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.hidden_norm = RMSNorm(a.dim, a.norm_eps)
        self.self_attn = Eagle3Attention(a)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.mlp = MLP(a)  # the target's MLP class: same names and shapes as vLLM's LlamaMLP

    def qkv_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [.., H heads x Dh] -> the layer's output before the final norm."""
        h = self.self_attn.o_proj(attn_out) + residual
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Head(nn.Module):
    """The head's weights under vLLM's checkpoint names (`fc`, `midlayer.*`, `norm`, `lm_head`,
    `d2t`, `t2d`)."""

    def __init__(self, args: Eagle3Args):
        super().__init__()
        a = args.target
        self.args = args
        self.fc = nn.Linear(args.fc_in, a.dim, bias=False)
        self.midlayer = Eagle3Layer(a)
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = nn.Linear(a.dim, args.draft_vocab_size, bias=False)
        # draft id -> target id offset, and which target ids the draft vocabulary holds
        self.register_buffer("d2t", torch.zeros(args.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(a.vocab_size, dtype=torch.bool))

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: `target_ids` [draft_vocab_size] sorted target ids."""
        ids = target_ids.to(torch.long).sort().values
        if ids.numel() != self.args.draft_vocab_size:
            raise ValueError(f"{ids.numel()} ids for a draft vocabulary of {self.args.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        return self.draft_to_target(torch.arange(self.args.draft_vocab_size, device=self.d2t.device))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of layer outputs (before the final norm)."""
        return self.lm_head(self.norm(out))

    def unrolled(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3's TTT): `steps` draft steps from every position at once.

        aux [B, L, fc_in]: the target's features at positions 0..L-1. embeds [B, L + steps - 1, D]:
        embeddings of tokens 1..L + steps - 1 (the token after each position, then the ones after).
        Step s at slot i is the draft's (s+1)-th token after a prefix ending at position i: it sits
        at position i + s, reads the embedding of token i + 1 + s and the previous step's output
        at slot i, and attends to step 0's keys at slots <= i (the target-feature keys of the
        prefix) plus its own chain's keys at slot i from steps 1..s, as vLLM's draft KV cache holds
        them. Returns each step's layer outputs [B, L, D] (before the final norm).
        """
        B, L, _ = aux.shape
        a, layer = self.args.target, self.midlayer
        attn = layer.self_attn
        cos_t, sin_t = rope_tables(a, L + steps, aux.device)
        sin_t = signed_sin(sin_t)
        hidden = self.fc(aux)
        causal = torch.ones(L, L, dtype=torch.bool, device=aux.device).tril()
        scale = 1.0 / math.sqrt(a.head_dim)
        group = a.n_heads // a.n_kv_heads
        keys, values, outs = [], [], []
        for s in range(steps):
            x = layer.qkv_input(embeds[:, s:s + L], hidden)
            cos, sin = cos_t[s:s + L].view(1, L, 1, -1), sin_t[s:s + L].view(1, L, 1, -1)
            q = apply_rope(attn.q_proj(x).view(B, L, a.n_heads, a.head_dim), cos, sin)
            k = apply_rope(attn.k_proj(x).view(B, L, a.n_kv_heads, a.head_dim), cos, sin)
            v = attn.v_proj(x).view(B, L, a.n_kv_heads, a.head_dim)
            k = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, L, Dh]
            v = v.repeat_interleave(group, dim=2).transpose(1, 2)
            q = q.transpose(1, 2)
            keys.append(k)
            values.append(v)
            prefix = (q @ keys[0].transpose(-1, -2)) * scale  # [B, H, L, L]
            prefix = prefix.masked_fill(~causal, float("-inf"))
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # [B, H, L, 1] each
            weights = torch.softmax(torch.cat([prefix, *own], dim=-1), dim=-1)
            o = weights[..., :L] @ values[0]
            for j, vv in enumerate(values[1:]):
                o = o + weights[..., L + j:L + j + 1] * vv
            out = layer.finish(o.transpose(1, 2).reshape(B, L, -1), hidden)
            outs.append(out)
            hidden = out
        return outs


def save_head(head: Eagle3Head, target_config: dict, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the head as vLLM loads it: config.json and model.safetensors (no embeddings), the
    weights in `dtype` (vLLM casts them to the engine's dtype when it loads them)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = head.args.hf_config(target_config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})


def load_head(folder: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """The head in `folder`, its weights cast to `dtype`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / WEIGHTS).is_file():
        raise ModelLoadError(f"{folder}: an EAGLE-3 head needs config.json and {WEIGHTS}")
    head = Eagle3Head(Eagle3Args.from_hf_config(json.loads((folder / "config.json").read_text())))
    state = load_file(str(folder / WEIGHTS))
    missing = sorted(set(head.state_dict()) - set(state))
    if missing:
        raise ModelLoadError(f"{folder}/{WEIGHTS} is missing {', '.join(missing[:5])}")
    head.load_state_dict({k: state[k].to(v.dtype) for k, v in head.state_dict().items()})
    return head.to(dtype=dtype).eval()
