"""The draft model: a small Llama with the target's tokenizer and vocabulary.

Why Llama: vLLM's `draft_model` speculation and the native engine's `DraftModelDrafter` both
load any Llama-family safetensors folder, and the draft must propose token ids the target
understands, so it shares the target's vocabulary (same ids) and ships its tokenizer files.

With a 49,152-token vocabulary the tied embedding / LM head is most of a small draft
(hidden 256: 12.6 M of ~14.6 M parameters), so the draft starts from the target's own
embeddings projected onto their top principal directions (`init_from_target`): the head
then ranks tokens roughly as the target's does from the first step, and training spends its
tokens on the layers.

Folder layout (what `save_draft` writes): config.json, model.safetensors (bf16 by default:
half the bytes, and both loaders cast to the target's dtype), the target's tokenizer files,
README.md (the model card) and `adaspec-draft.json` (what was trained, on what, measured how).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from distill import DistillError
from native_engine.model import ModelArgs, Transformer, build_model

DRAFT_MARKER = "adaspec-draft.json"
CANDIDATES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # final-norm scales tried at initialisation
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


@dataclass(frozen=True)
class DraftShape:
    layers: int = 3  # decoder layers; the head dominates cost, so a few layers are cheap
    hidden: int = 256  # bf16 embedding at 256 = 25.2 MB, under the 30 MB budget with 3 layers
    heads: int = 4  # head_dim = hidden / heads = 64, as the target
    kv_heads: int = 2
    intermediate: int = 512


def draft_args(target: ModelArgs, shape: DraftShape) -> ModelArgs:
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise DistillError(f"--hidden {shape.hidden} must split into {shape.heads} heads "
                           f"of {shape.kv_heads} key-value groups")
    return ModelArgs(
        vocab_size=target.vocab_size, dim=shape.hidden, n_layers=shape.layers, n_heads=shape.heads,
        n_kv_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads, intermediate_size=shape.intermediate,
        rope_theta=target.rope_theta, rope_llama3=target.rope_llama3, norm_eps=target.norm_eps,
        tie_embeddings=True, max_position=target.max_position,
    )


@torch.no_grad()
def init_from_target(draft: Transformer, target: Transformer) -> None:
    """Embeddings = the target's projected onto their top `hidden` right singular vectors.

    Target logits are h . E^T; with E ~ (E P) P^T (P: top principal directions), a draft
    whose final normed hidden state is ~ h P reproduces them. The final norm starts at the
    target's mean scale so logits start at the target's temperature.
    """
    E = target.lm_head.weight.float()  # [V, D_target]; the embeddings when tied, else the head
    d = draft.args.dim
    if d >= E.shape[1]:
        proj = torch.eye(E.shape[1], d)
    else:
        _, _, Vh = torch.linalg.svd(E, full_matrices=False)  # Vh [D_target, D_target]
        proj = Vh[:d].T  # [D_target, d]
    draft.model.embed_tokens.weight.copy_((E @ proj).to(draft.model.embed_tokens.weight.dtype))
    scale = target.model.norm.weight.float().abs().mean()
    draft.model.norm.weight.fill_(float(scale))
    # Residual writes start small, so at step 0 the draft is close to "embedding -> head".
    for layer in draft.model.layers:
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)


@torch.no_grad()
def calibrate_head_scale(draft: Transformer, batch: tuple, loss_fn) -> float:
    """Pick the final norm's scale (the logits' temperature) that best fits the teacher on one
    batch: the projected embeddings' norms differ from the target's hidden states', so the
    initial scale is far off (KD loss ~70 nats at 1x on SmolLM2). Returns the scale chosen."""
    w = draft.model.norm.weight
    base = w.clone()
    best = (float("inf"), 1.0)
    for s in CANDIDATES:
        w.copy_(base * s)
        best = min(best, (float(loss_fn(draft, *batch)[0]), s))
    w.copy_(base * best[1])
    return best[1]


def new_draft(target: Transformer, shape: DraftShape, seed: int = 0) -> Transformer:
    draft = build_model(draft_args(target.args, shape), dtype=torch.float32, seed=seed)
    for name, p in draft.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
    init_from_target(draft, target)
    return draft.train()


def hf_config(args: ModelArgs, target_config: dict) -> dict:
    """config.json for a draft: Llama, the target's special token ids, tied embeddings."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "max_position_embeddings": args.max_position,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": target_config.get("bos_token_id"), "eos_token_id": target_config.get("eos_token_id"),
        "pad_token_id": target_config.get("pad_token_id"), "torch_dtype": "bfloat16",
        "initializer_range": 0.02, "use_cache": True,
    }


def check_output_folder(out: Path) -> None:
    """Refuse a folder that holds anything but an earlier draft (which may be replaced)."""
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {out} exists and is not a folder; nothing was written")
    if out.is_dir() and any(out.iterdir()) and not (out / DRAFT_MARKER).is_file():
        raise DistillError(f"--out {out} is not empty and holds no adaspec draft ({DRAFT_MARKER}); "
                           "choose an empty or new folder; nothing was written")


def save_draft(draft: Transformer, target_folder: Path, out: Path, card: str, info: dict,
               dtype: torch.dtype = torch.bfloat16, tokenizer: bool = True) -> Path:
    """Write the draft folder atomically (a temporary sibling, then a rename); return it.

    tokenizer=False leaves the target's tokenizer files out (SmolLM2's tokenizer.json is
    3.5 MB): vLLM's `draft_model` and the native engine tokenise with the target's anyway."""
    from safetensors.torch import save_file

    check_output_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    state = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    target_config = json.loads((target_folder / "config.json").read_text())
    config = hf_config(draft.args, target_config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES if tokenizer else ("generation_config.json",):
        if (target_folder / name).is_file():
            shutil.copy2(target_folder / name, partial / name)
    (partial / "README.md").write_text(card)
    files = sorted(p.name for p in partial.iterdir()) + [DRAFT_MARKER]
    (partial / DRAFT_MARKER).write_text(json.dumps({**info, "files": files}, indent=2))
    if out.exists():
        shutil.rmtree(out)  # an earlier draft (check_output_folder refused anything else)
    partial.rename(out)
    return out


def check_compatible(target_folder: Path, draft_folder: Path) -> None:
    """The draft must share the target's vocabulary and tokenizer, or its ids mean other tokens."""
    t = json.loads((target_folder / "config.json").read_text())
    d = json.loads((draft_folder / "config.json").read_text())
    if t.get("vocab_size") != d.get("vocab_size"):
        raise DistillError(f"draft {draft_folder} has vocab_size {d.get('vocab_size')}, target {target_folder} "
                           f"has {t.get('vocab_size')}: they cannot share token ids")
    tj, dj = target_folder / "tokenizer.json", draft_folder / "tokenizer.json"
    if tj.is_file() and dj.is_file() and json.loads(tj.read_text()).get("model") != json.loads(dj.read_text()).get("model"):
        raise DistillError(f"draft {draft_folder} and target {target_folder} have different tokenizers")
