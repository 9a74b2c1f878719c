"""The EAGLE-3 head (native_engine/eagle3.py) and its training (distill/eagle3_*.py), on tiny
random models: training-time test computes what step-by-step drafting computes, the folder has
vLLM's names and config, and training on a target's features makes the head agree with it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from distill.eagle3_data import FeatureSettings, build, choose_vocabulary
from distill.eagle3_eval import chain_acceptance
from distill.eagle3_train import HeadTrainSettings, init_from_target, train
from distill.evaluate import replay_chains
from distill.teacher import TeacherSequence
from native_engine.eagle3 import Eagle3Args, Eagle3Head, default_aux_layers, load_head, save_head
from native_engine.model import ModelArgs, apply_rope, rope_tables, signed_sin

TINY = ModelArgs(vocab_size=64, dim=32, n_layers=8, n_heads=2, n_kv_heads=1, head_dim=16, intermediate_size=64,
                 rope_theta=10000.0, max_position=256)
VLLM_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def _head(draft_vocab: int = 40, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Args(TINY, draft_vocab, default_aux_layers(TINY.n_layers)))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    head.set_vocabulary(torch.randperm(TINY.vocab_size)[:draft_vocab])
    return head


def _step_by_step(head: Eagle3Head, aux: torch.Tensor, embeds: torch.Tensor, c: int, steps: int) -> list[torch.Tensor]:
    """Drafting as an engine does it after a prefix ending at position c: keys of positions 0..c
    from the target's features, then each draft step appends its own key at the next position
    and reads the previous step's output."""
    a, layer = head.args.target, head.midlayer
    attn = layer.self_attn
    cos_t, sin_t = rope_tables(a, c + steps + 1)
    sin_t = signed_sin(sin_t)

    def project(x, pos):
        cos, sin = cos_t[pos].view(1, 1, -1), sin_t[pos].view(1, 1, -1)
        q = apply_rope(attn.q_proj(x).view(1, a.n_heads, a.head_dim), cos, sin)[0]
        k = apply_rope(attn.k_proj(x).view(1, a.n_kv_heads, a.head_dim), cos, sin)[0]
        return q, k, attn.v_proj(x).view(a.n_kv_heads, a.head_dim)

    features = head.fc(aux)
    keys, values = [], []
    for j in range(c + 1):  # the prefix's draft KV, from the target's features
        _, k, v = project(layer.qkv_input(embeds[j], features[j]), j)
        keys.append(k)
        values.append(v)
    hidden, outs = features[c], []
    for s in range(steps):
        pos = c + s
        q, k, v = project(layer.qkv_input(embeds[c + s], hidden), pos)
        if s > 0:
            keys.append(k)
            values.append(v)
        K = torch.stack(keys).repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)  # [S, H, Dh]
        V = torch.stack(values).repeat_interleave(a.n_heads // a.n_kv_heads, dim=1)
        w = torch.softmax((q[None] * K).sum(-1) / math.sqrt(a.head_dim), dim=0)  # [S, H]
        o = (w[..., None] * V).sum(0).reshape(-1)
        hidden = layer.finish(o, hidden)
        outs.append(hidden)
    return outs


@torch.no_grad()
def test_training_time_test_computes_what_step_by_step_drafting_computes():
    head = _head()
    L, steps = 12, 3
    aux = torch.randn(1, L, head.args.fc_in)
    embeds = torch.randn(1, L + steps - 1, TINY.dim)
    unrolled = head.unrolled(aux, embeds, steps)
    for c in (0, 5, L - 1):
        reference = _step_by_step(head, aux[0], embeds[0], c, steps)
        for s in range(steps):
            torch.testing.assert_close(unrolled[s][0, c], reference[s], rtol=1e-5, atol=1e-5)


def test_saved_folder_has_vllm_names_and_config_and_loads_back(tmp_path):
    head = _head()
    target_config = {"bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                     "max_position_embeddings": 256}
    save_head(head, target_config, tmp_path / "head", dtype=torch.float32)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "head" / "model.safetensors"))) == VLLM_NAMES
    save_head(head, target_config, tmp_path / "bf16")  # the default: half the bytes, vLLM casts at load
    stored = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.long
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == TINY.vocab_size
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # vLLM's registry maps the architecture to its EAGLE-3 Llama, and its d2t convention
    # (target id = draft id + d2t, llama_eagle3.py compute_logits) gives back the vocabulary.
    from vllm.model_executor.models.registry import _VLLM_MODELS

    assert _VLLM_MODELS["LlamaForCausalLMEagle3"] == ("llama_eagle3", "Eagle3LlamaForCausalLM")
    loaded = load_head(tmp_path / "head")
    assert torch.equal(torch.arange(40) + loaded.d2t, head.target_ids())
    assert bool(loaded.t2d[head.target_ids()].all()) and int(loaded.t2d.sum()) == 40
    aux, embeds = torch.randn(2, 6, head.args.fc_in), torch.randn(2, 7, TINY.dim)
    with torch.no_grad():
        torch.testing.assert_close(loaded.unrolled(aux, embeds, 2)[1], head.unrolled(aux, embeds, 2)[1])


def test_replay_of_chains_whose_tokens_depend_on_where_the_chain_started():
    # chains[i, t]: the i-th token of a chain starting at t. From t=0 the first token is
    # accepted and the second rejected; the step after restarts at t=2, whose first token is
    # rejected; the next starts at t=3: accepted, accepted (path ends at 5 tokens).
    chains = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 1, 1, 0]], dtype=torch.double)
    rates, lengths = replay_chains([chains])
    assert rates == [pytest.approx(2 / 3), pytest.approx(1 / 2)]
    assert lengths[2] == pytest.approx((2 + 1 + 3) / 3)  # t=0: 1 + bonus; t=2: bonus; t=3: 2 + bonus


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A random Hugging Face Llama whose next token depends on the last one only (its layers
    add nothing to the residual stream): a bigram a head can learn in a few hundred steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=TINY.vocab_size, hidden_size=TINY.dim, intermediate_size=TINY.intermediate_size,
                         num_hidden_layers=TINY.n_layers, num_attention_heads=TINY.n_heads,
                         num_key_value_heads=TINY.n_kv_heads, head_dim=TINY.head_dim, max_position_embeddings=256,
                         tie_word_embeddings=False, initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(0.0)
            layer.self_attn.o_proj.weight.mul_(0.0)
    folder = tmp_path_factory.mktemp("eagle-target") / "target"
    model.save_pretrained(folder)
    return folder


def _sequences(n: int, seed: int, tiny_target: Path, sample: bool) -> list[TeacherSequence]:
    """The target's own continuations of random 4-token prompts (what a head drafts for)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_target).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, TINY.vocab_size, (n, 4), generator=g)
    with torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(prompts, max_new_tokens=28, do_sample=sample, top_k=0, pad_token_id=0)
    return [TeacherSequence(row.to(torch.int32), 4, torch.zeros(0), torch.zeros(0)) for row in out]


def test_training_on_the_targets_features_makes_the_head_agree_with_it(tiny_target, tmp_path):
    fs = FeatureSettings(aux_layers=default_aux_layers(TINY.n_layers), top_k=8)
    data = build(tiny_target, _sequences(192, 0, tiny_target, sample=True), tmp_path / "features", fs, "tiny")
    held = build(tiny_target, _sequences(32, 1, tiny_target, sample=False), tmp_path / "held", fs, "tiny")
    assert data[0].aux.shape == (32, TINY.dim * 3) and data[0].aux.dtype == torch.bfloat16
    ids, coverage = choose_vocabulary(data, 48, TINY.vocab_size)
    assert len(ids) == 48 and 0.5 < coverage <= 1.0
    head = Eagle3Head(Eagle3Args(TINY, 48, fs.aux_layers))
    head.set_vocabulary(ids)
    from safetensors.torch import load_file

    weights = load_file(str(tiny_target / "model.safetensors"))
    init_from_target(head, weights)
    embed = torch.nn.Embedding.from_pretrained(weights["model.embed_tokens.weight"])

    def first_position_acceptance() -> float:
        chains = [chain_acceptance(head, embed, s, 2, 0.0) for s in held]
        return replay_chains([c for c in chains if c is not None])[0][0]

    before = first_position_acceptance()
    state = train(head, embed, data, HeadTrainSettings(steps=2, tokens_per_batch=512, lr=2e-2, warmup=10),
                  deadline=float("inf"), epochs=8)
    after = first_position_acceptance()
    assert state.losses[-1] < state.losses[0] * 0.9, state.losses
    assert after > 0.6 and before < 0.3, (before, after)
    print(f"\n[eagle3 tiny] acceptance at position 1: {before:.3f} -> {after:.3f}; loss {state.losses[0]:.2f} -> "
          f"{state.losses[-1]:.2f}")
