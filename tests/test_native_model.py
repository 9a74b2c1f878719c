"""Native model code: logits equal HF transformers' on the same weights (Llama with GQA, Qwen2
with QKV bias, llama3 RoPE scaling), safetensors folders load, bad folders fail clearly, and
the KV-cache path equals the cache-free forward."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from native_engine import cpu_kernels
from native_engine.dtype_choice import cpu_has_bf16
from native_engine.kv_cache import KVCache
from native_engine.attention import attend, causal_mask
from native_engine.model import ModelArgs, ModelLoadError, Transformer, build_model, load_model
from native_engine.testing import full_logits, tiny_args
from native_engine.tree import attention_mask


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _hf_pair(arch: str, tie: bool, **extra):
    """A tiny random HF model and our model built from its config.json with its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls_cfg, cls_model = {"LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
                          "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    cfg = cls_cfg(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie, **extra)
    hf = cls_model(cfg).eval()
    d = cfg.to_dict()
    d["architectures"] = [arch]
    ours = Transformer(ModelArgs.from_hf_config(d))
    ours.load_state_dict(hf.state_dict(), strict=not tie)
    return hf, ours.eval(), d


@pytest.mark.parametrize("arch,tie,extra", [
    ("LlamaForCausalLM", True, {}),
    ("LlamaForCausalLM", False, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8}}),
    ("Qwen2ForCausalLM", True, {}),
])
def test_logits_match_hf_transformers(arch, tie, extra):
    hf, ours, _ = _hf_pair(arch, tie, **extra)
    assert ours.args.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert (ours.args.rope_llama3 is not None) == ("rope_parameters" in extra)
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        hidden = ours(tokens, torch.arange(13)[None].expand(2, 13), causal_mask(torch.tensor([13, 13]), 13))
        assert torch.allclose(ours.logits(hidden), ref, atol=1e-4), (ours.logits(hidden) - ref).abs().max()


@pytest.mark.parametrize("arch,tie", [("LlamaForCausalLM", True), ("Qwen2ForCausalLM", False)])
def test_bfloat16_logits_match_hf_transformers_in_bfloat16(arch, tie):
    """In bfloat16 (RMSNorm in float32, RoPE and the rest in bfloat16, as HF computes them),
    before and after prepare_for_serving: within 0.01 of HF's bfloat16 logits (logits of
    about 1, a few bfloat16 steps), and no farther from the float32 logits than twice HF's
    own bfloat16 error."""
    hf, ours, _ = _hf_pair(arch, tie)
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    pos, mask = torch.arange(13)[None].expand(2, 13), causal_mask(torch.tensor([13, 13]), 13)
    with torch.no_grad():
        ref = hf(tokens).logits
        hf16 = hf.to(torch.bfloat16)(tokens).logits.float()
        ours = ours.to(torch.bfloat16)
        for stage in ("as loaded", "served"):
            if stage == "served":
                ours.prepare_for_serving()
            got = ours.logits(ours(tokens, pos, mask))
            assert (got - hf16).abs().max() <= 0.01, (stage, (got - hf16).abs().max())
            assert (got - ref).abs().max() <= 2 * (hf16 - ref).abs().max(), stage


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,masked", [(1, False), (5, False), (5, True)])
def test_folded_grouped_query_attention_equals_sdpa(dtype, T, masked):
    """attend() folds a group's query heads into one head's rows: the same output as torch's
    grouped-query attention, with and without a mask, one query or several."""
    B, H, Hkv, S, Dh = 3, 6, 2, 11, 8
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((B, H, T, Dh), (B, Hkv, S, Dh), (B, Hkv, S, Dh)))
    mask = None
    if masked:
        mask = torch.rand(B, 1, T, S, generator=gen) > 0.4
        mask[..., 0] = True  # every query attends at least one key
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    assert torch.allclose(attend(q, k, v, mask).float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("arch,tie", [("LlamaForCausalLM", True), ("Qwen2ForCausalLM", False)])
def test_prepare_for_serving_keeps_the_logits(arch, tie):
    hf, ours, _ = _hf_pair(arch, tie)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    pos, mask = torch.arange(9)[None].expand(2, 9), causal_mask(torch.tensor([9, 6]), 9)
    with torch.no_grad():
        before = ours.logits(ours(tokens, pos, mask))
        served = ours.prepare_for_serving()
        assert served is ours and ours.serving and ours.prepare_for_serving() is ours  # twice: no change
        layer = ours.model.layers[0]
        assert layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
        assert layer.mlp.gate_up_proj is not None and not hasattr(layer.mlp, "up_proj")
        # on a CPU every matmul is a CpuLinear, the lm_head too; the embedding is untouched
        assert not any(type(m) is torch.nn.Linear for m in ours.modules())
        one = ours.logits(ours(tokens[:1, :1], pos[:1, :1], causal_mask(torch.tensor([1]), 1)))  # the M = 1 path
        assert torch.allclose(one, before[:1, :1], atol=1e-5)
        assert ours.lm_head.weight.shape == (97, 64) and ours.lm_head.weight.data_ptr() != \
            ours.model.embed_tokens.weight.data_ptr()
        after = ours.logits(ours(tokens, pos, mask))
        assert torch.allclose(after, before, atol=1e-5), (after - before).abs().max()


@pytest.mark.parametrize("path", ["gemv", "linear", "packed", "panels"])
def test_bfloat16_cpu_linear_matches_nn_linear_on_every_path(path):
    """bf16 weights get oneDNN's prepacked layout too where the CPU supports bf16, and
    adaspec's panel kernel where it builds (fp32 accumulation): every path agrees with
    nn.Linear within bf16 rounding of the output."""
    from native_engine.cpu_linear import CpuLinear

    if path == "packed" and not cpu_has_bf16():
        pytest.skip("this CPU has no oneDNN bf16")
    if path == "panels" and not cpu_kernels.load():
        pytest.skip("adaspec's CPU kernels need an x86 CPU with AVX2 and a C++ compiler")
    linear = torch.nn.Linear(96, 160, bias=False).to(torch.bfloat16)
    fast = CpuLinear(linear)
    assert path != "packed" or fast.packed is not None
    fast.use((path,) * 6)
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        with torch.no_grad():
            ref, out = linear(x).float(), fast(x).float()
        assert torch.allclose(out, ref, atol=2e-2, rtol=1e-2), (path, rows, (out - ref).abs().max())


def test_hf_folder_loads_with_tied_embeddings(tmp_path):
    hf, _, cfg = _hf_pair("LlamaForCausalLM", True)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokens = [5, 9, 2, 40, 7]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert torch.allclose(full_logits(model, tokens), ref, atol=1e-4)
    assert load_model(tmp_path, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def _write_folder(tmp_path, cfg: dict, state: dict | None):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if state is not None:
        save_file(state, str(tmp_path / "model.safetensors"))


def test_bad_model_folders_name_the_problem(tmp_path):
    _, ours, cfg = _hf_pair("LlamaForCausalLM", True)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    _write_folder(tmp_path, cfg, None)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00001.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    state = {k: v.contiguous() for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    state.pop("model.layers.1.mlp.up_proj.weight")
    _write_folder(tmp_path, cfg, state)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)
    _write_folder(tmp_path, {**cfg, "architectures": ["GPT2LMHeadModel"]}, None)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tmp_path)
    _write_folder(tmp_path, {**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, None)
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_cached_tree_forward_equals_cache_free_forward(dtype, atol):
    """Prefill into the cache, then one tree pass: each node's logits equal a cache-free
    forward over prefix + that node's ancestors (positions by depth, tree mask)."""
    model = build_model(tiny_args(), dtype=dtype, seed=3, init_std=0.1)
    a = model.args
    cache = KVCache.allocate(a.n_layers, 2, a.n_kv_heads, 64, a.head_dim, dtype)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    P = len(prompt)
    pos = torch.arange(P)[None]
    with torch.no_grad():
        model(torch.tensor([prompt]), pos, attention_mask(causal_mask(torch.tensor([P]), P)[:, 0],
                                                          torch.tensor([0]), P), cache, 1, pos, P)
    # root 6 at position P, nodes: 0:(7) 1:(8) under root, 2:(10) under node 0, 3:(11) under node 2
    parents, node_tokens = [-1, -1, 0, 2], [7, 8, 10, 11]
    from native_engine.tree import DraftTree, batch_tree_inputs
    tree = DraftTree(node_tokens, parents, [1.0] * 4)
    tokens, positions, write, block = batch_tree_inputs([tree], [6], [P])
    key_len = P + tokens.shape[1]
    with torch.no_grad():
        hidden = model(tokens, positions, attention_mask(block, torch.tensor([P]), key_len), cache, 1, write, key_len)
        logits = model.logits(hidden[0])
    paths = {0: [6], 1: [6, 7], 2: [6, 8], 3: [6, 7, 10], 4: [6, 7, 10, 11]}
    for row, path in paths.items():
        ref = full_logits(model, prompt + path)[-1]
        assert torch.allclose(logits[row], ref, atol=atol), (row, (logits[row] - ref).abs().max())


def test_model_args_from_smollm2_style_config():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}
    args = ModelArgs.from_hf_config(cfg)
    assert (args.rope_theta, args.n_kv_heads, args.tie_embeddings) == (100000.0, 3, True)
    assert args.num_params() == pytest.approx(134.5e6, rel=0.01)
    mistral = ModelArgs.from_hf_config({**cfg, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.max_position == 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_matches_cpu():
    model = build_model(tiny_args(), seed=3, init_std=0.1)
    tokens = [1, 2, 3, 4, 5, 6]
    ref = full_logits(model, tokens)
    gpu = full_logits(model.to("cuda", torch.bfloat16), tokens).cpu()
    assert (gpu.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_bfloat16_attention_over_whole_key_blocks_is_the_same_whatever_masked_keys_follow():
    """A one-token pass holds exactly the keys its query attends; a verify pass or a batch
    holds more, masked for it. Read in whole KEY_BLOCKs (attention.whole_key_blocks), the query
    gets the same bits either way (torch's CPU kernel sums a block that ends early another way)."""
    from native_engine.attention import whole_key_blocks

    gen = torch.Generator().manual_seed(0)
    for keys_attended in range(20, 300, 7):
        keys, values = (torch.randn(1, 3, keys_attended + 64, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
        q = torch.randn(1, 9, 1, 64, generator=gen).to(torch.bfloat16)

        def pass_holding(n: int) -> torch.Tensor:
            mask = torch.zeros(1, 1, 1, n, dtype=torch.bool)
            mask[..., :keys_attended] = True
            mask, key_len = whole_key_blocks(None if n == keys_attended else mask, n)
            return attend(q, keys[:, :, :key_len], values[:, :, :key_len], mask)

        alone = pass_holding(keys_attended)
        for extra in (3, 5, 37):
            assert torch.equal(alone, pass_holding(keys_attended + extra)), (keys_attended, extra)
