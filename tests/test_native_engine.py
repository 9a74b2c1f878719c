"""The native engine on tiny random models: greedy output of every speculation shape equals
the target's own greedy decoding (and HF transformers'), with requests joining and leaving
mid-run; the KV cache after rejections equals recomputation; live policies; StepRecords;
finish conditions; clear errors for impossible configs and requests."""

from __future__ import annotations

import pytest
import torch

from adaspec.policy import PolicyError, SpecConfig, SpecPolicy
from controller.acceptance import AcceptanceModel, step_counts
from native_engine.drafters import DraftModelDrafter, NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.kv_cache import KVCache
from native_engine.attention import causal_mask
from native_engine.requests import SamplingParams
from native_engine.testing import CharTokenizer, reference_greedy
from native_engine.tree import TreeShape, attention_mask
from testkit.tiny_engine import SHAPES, engine_for, make_draft, make_prompts, make_target, run_mixed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def draft(target):
    return make_draft(target)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def references(target, prompts):
    return [reference_greedy(target, p, 30) for p in prompts]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_equals_the_targets_own_decoding_with_joins_and_leaves(target, draft, prompts, references,
                                                                     drafter, shape):
    engine = engine_for(target, draft, drafter, shape)
    max_tokens = [30, 12, 25, 30, 7, 20]
    outputs, reasons = run_mixed(engine, prompts, max_tokens, join_at=[0, 0, 1, 3, 4, 9], abort={3: 6})
    for i, ref in enumerate(references):
        if i == 3:  # aborted mid-run: what it produced is a prefix of the reference
            assert reasons[i] == "abort" and outputs[i] == ref[: len(outputs[i])]
        else:
            assert reasons[i] == "length" and outputs[i] == ref[: max_tokens[i]], i
    report = engine.drain()
    steps = report.steps
    assert max(s.batch_size for s in steps) == 3  # the batch really was mixed
    # One RequestRecord per finished request, none for the aborted one.
    finished = report.requests
    assert sorted(r.output_tokens for r in finished) == sorted(m for i, m in enumerate(max_tokens) if i != 3)
    assert all(1 <= r.mean_batch <= 3 and r.latency_s > 0 and str(r.config) == shape.split("@")[0] for r in finished)
    if shape != "off":
        accepted = sum(sum(s.accepted_per_pos) for s in steps)
        assert accepted > 0, "no draft token was ever accepted: the test would not exercise verification"


def test_greedy_equals_hf_transformers_on_the_same_weights():
    from transformers import LlamaConfig, LlamaForCausalLM

    from native_engine.model import ModelArgs, Transformer

    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      initializer_range=0.2)
    hf = LlamaForCausalLM(cfg).eval()
    d = cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    ours = Transformer(ModelArgs.from_hf_config(d))
    ours.load_state_dict(hf.state_dict(), strict=False)
    ours.eval()
    prompt = [3, 17, 4, 17, 4, 9]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(20):  # HF's own greedy loop (no generate() defaults involved)
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    hf_out = ids[0, len(prompt):].tolist()
    for shape in ["off", "chain4", "tree4x2x2x1"]:
        engine = NativeEngine(ours, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=2, max_seq_len=128),
                              SpecPolicy.parse(shape))
        assert engine.generate([prompt], SamplingParams(max_tokens=20)) == [hf_out], shape


def _recomputed_kv(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    a = model.args
    cache = KVCache.allocate(a.n_layers, 1, a.n_kv_heads, len(tokens), a.head_dim)
    T = len(tokens)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        model(torch.tensor([tokens]), pos, attention_mask(causal_mask(torch.tensor([T]), T)[:, 0],
                                                          torch.tensor([0]), T), cache, 0, pos, T)
    return cache.k[:, 0, :, :T], cache.v[:, 0, :, :T]


def test_prompts_of_uneven_length_prefill_one_after_another_as_if_alone(target, monkeypatch):
    """Two prompts admitted in one step run one prefill pass, their tokens one after another
    (no padding; attention prompt by prompt): each one's first token and cached keys/values
    equal its prefill alone and a recomputation under the causal mask."""
    from native_engine import attention

    seen = []
    monkeypatch.setattr(attention, "prompt_attention",
                        lambda q, *a, _f=attention.prompt_attention: seen.append(q.shape[1]) or _f(q, *a))
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 6, 2, 9, 9, 1, 5, 3, 7, 2, 8, 6]]
    together = NativeEngine(target, None, EngineConfig(max_batch_size=2, max_seq_len=96), SpecPolicy.parse("off"))
    for i, p in enumerate(prompts):
        together.add_request(str(i), p, SamplingParams(max_tokens=4))
    firsts = {o.request_id: o.new_token_ids for o in together.step()}
    assert seen == [20] * target.args.n_layers, "the prefill did not run as one pass of 20 tokens"
    for i, p in enumerate(prompts):
        alone = NativeEngine(target, None, EngineConfig(max_batch_size=1, max_seq_len=96), SpecPolicy.parse("off"))
        alone.add_request("a", p, SamplingParams(max_tokens=4))
        (out,) = alone.step()
        assert firsts[str(i)] == out.new_token_ids == reference_greedy(target, p, 1)
        row = next(r.row for r in together.running if r.request_id == str(i))
        k, v = _recomputed_kv(target, p)
        for cache_t, alone_t, masked in ((together.cache.k, alone.cache.k, k), (together.cache.v, alone.cache.v, v)):
            assert torch.allclose(cache_t[:, row, :, :len(p)], alone_t[:, 0, :, :len(p)], atol=1e-6)
            assert torch.allclose(cache_t[:, row, :, :len(p)], masked, atol=1e-5)
        # Past the prompt, the row holds nothing of the other prompt (no pad tokens written).
        assert not together.cache.k[:, row, :, len(p):].any()

@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_kv_cache_after_rejections_equals_recomputation(target, draft, prompts, drafter):
    engine = engine_for(target, draft, drafter, "tree4x2x2x1", max_batch=3)
    for i in (0, 1, 4):
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=40))
    deep = 0
    for _ in range(9):
        engine.step()
        # With 4 root children, a path reaching depth 2 is not contiguous in verify order
        # (its depth-2 node sits after all depth-1 nodes), so the cache had to be compacted.
        deep += sum(engine.drain().steps[-1].accepted_per_pos[1:2])  # [] in the prefill step
    assert deep > 0, "no path reached depth 2: cache compaction not exercised"
    for req in engine.running:
        committed = req.context[: req.cache_len]
        assert req.cache_len == len(req.context) - 1  # everything but the root
        k, v = _recomputed_kv(target, committed)
        n = req.cache_len
        assert torch.allclose(engine.cache.k[:, req.row, :, :n], k[:, :, :n], atol=1e-5)
        assert torch.allclose(engine.cache.v[:, req.row, :, :n], v[:, :, :n], atol=1e-5)
        if drafter == "draft_model":
            held = engine.drafter.cached[req.row]
            dk, _ = _recomputed_kv(draft, req.context[:held])
            assert torch.allclose(engine.drafter.cache.k[:, req.row, :, :held], dk, atol=1e-5)


def test_live_policy_change_takes_effect_at_the_next_step(target, draft, prompts, references):
    engine = engine_for(target, draft, "draft_model", "chain4", max_batch=4)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=30))
    engine.step()  # prefill
    engine.step()
    assert str(engine.drain().steps[-1].config) == "chain4"
    ack = engine.apply_policy(SpecPolicy.parse("1-1:tree2x2,2+:off", version=3))
    assert ack.status == "applied" and ack.version_in_force == 3
    engine.step()
    rec = engine.drain().steps[-1]
    assert (str(rec.config), rec.policy_version, len(rec.reached_per_depth_rank)) == ("tree2x2", 3, 2)
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=30))
    engine.step()  # batch 2 now: off
    engine.step()
    rec = engine.drain().steps[-1]
    assert (str(rec.config), rec.num_drafts, rec.draft_k, rec.scheduled_tokens) == ("off", 0, 0, 2)
    stale = engine.apply_policy(SpecPolicy.parse("chain2", version=2))
    assert stale.status == "ignored_stale" and stale.version_in_force == 3
    out = {"a": [], "b": []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert out["a"] == references[0][len(references[0]) - len(out["a"]):][: len(out["a"])]


def test_step_records_have_consistent_counts_and_feed_the_controller(target, draft, prompts):
    engine = engine_for(target, draft, "draft_model", "tree3x2x1", max_batch=4)
    for i in range(4):
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=192 - len(prompts[i]) - 65))
    gained = []
    for _ in range(12):
        outs = engine.step()
        gained.append(sum(len(o.new_token_ids) for o in outs))
    steps = engine.drain().steps
    assert steps[0].prefill_tokens == sum(len(p) for p in prompts[:4]) and steps[0].num_decode_reqs == 0
    for s, g in zip(steps[1:], gained[1:]):
        assert str(s.config) == "tree3x2x1" and s.draft_k == 3 and s.num_decode_reqs == 4
        assert g == s.num_decode_reqs + sum(s.accepted_per_pos)  # 1 + accepted per sequence
        assert s.num_drafts <= s.num_decode_reqs
        assert s.scheduled_tokens == s.num_decode_reqs * (1 + SpecConfig.parse("tree3x2x1").num_nodes)
        for d in range(3):
            assert s.accepted_per_pos[d] == sum(s.accepted_per_depth_rank[d])
            assert all(a <= r for a, r in zip(s.accepted_per_depth_rank[d], s.reached_per_depth_rank[d]))
            assert s.accepted_per_pos[d] <= s.drafted_per_pos[d] <= s.num_decode_reqs
        assert s.reached_per_depth_rank[0][0] == s.num_decode_reqs  # every sequence tries rank 0
        assert s.context_tokens > 0 and s.duration_s > 0
    reached, accepted = step_counts(steps[-1])
    assert reached.shape == (3, 3)
    model = AcceptanceModel()
    model.update(steps)
    assert 1.0 < model.expected_length(SpecConfig.parse("tree3x2x1")) < 4.0


def test_impossible_configs_are_refused_with_clear_errors(target, draft):
    # The engine's capabilities are fixed when it starts: a drafter of depth 4 from the start.
    engine = NativeEngine(target, DraftModelDrafter(draft, 2, 192, max_depth=4),
                          EngineConfig(max_batch_size=2, max_seq_len=192, max_tree_nodes=20), SpecPolicy.parse("off"))
    deep = engine.apply_policy(SpecPolicy.parse("chain6", version=1))
    assert deep.status == "rejected" and "drafts 6 tokens" in deep.message
    wide = engine.apply_policy(SpecPolicy.parse("tree4x4x2", version=1))
    assert wide.status == "rejected" and "52 draft nodes" in wide.message and "max_tree_nodes=20" in wide.message
    short = engine.apply_policy(SpecPolicy.parse("1-1:chain2", version=1))
    assert short.status == "rejected" and "batch sizes up to 1" in short.message
    assert engine.policy.version == 0 and str(engine.policy) == "1+:off"
    for text in ["tree", "tree0x2", "tree2x"]:
        with pytest.raises(PolicyError):
            SpecConfig.parse(text)
    with pytest.raises(PolicyError, match="drafts 2 tokens"):
        NativeEngine(target, None, EngineConfig(max_batch_size=2), SpecPolicy.parse("chain2"))
    budgeted = NativeEngine(target, NgramDrafter(), EngineConfig(max_batch_size=2, max_tree_nodes=20, tree_budget=16))
    assert budgeted.apply_policy(SpecPolicy.parse("tree4x4x2", version=1)).status == "applied"
    small = NativeEngine(target, DraftModelDrafter(draft, 2, 64, max_expanded_nodes=40),
                         EngineConfig(max_batch_size=2, max_seq_len=64, max_tree_nodes=20, tree_budget=16))
    expanded = small.apply_policy(SpecPolicy.parse("tree4x4x2", version=1))
    assert expanded.status == "rejected" and "expands up to 52 draft nodes" in expanded.message
    # A budget caps what a deep shape expands: 62 nodes in full, at most 2+4+8+8+8 best-first.
    small_budget = NativeEngine(target, DraftModelDrafter(draft, 2, 64, max_expanded_nodes=40),
                                EngineConfig(max_batch_size=2, max_seq_len=64, max_tree_nodes=20, tree_budget=4))
    deep = small_budget.apply_policy(SpecPolicy.parse("tree2x2x2x2x2", version=1))
    assert deep.status == "applied", deep.message


def test_request_errors_and_finish_conditions(target, draft, prompts, references):
    tok = CharTokenizer()
    engine = NativeEngine(target, NgramDrafter(), EngineConfig(max_batch_size=2, max_seq_len=128),
                          SpecPolicy.parse("tree2x2"), tokenizer=tok, eos_token_ids=(references[0][7],))
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        engine.add_request("long", [1] * 100, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [])
    engine.add_request("eos", prompts[0], SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("eos", prompts[0])
    ref = references[1]
    stop_text = tok.decode(ref[5:7])
    first = tok.decode(ref).find(stop_text)
    engine.add_request("stop", prompts[1], SamplingParams(max_tokens=30, stop=(stop_text,), ignore_eos=True))
    final = {}
    tokens = {"eos": [], "stop": []}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    eos_at = references[0].index(references[0][7])
    assert final["eos"].finish_reason == "stop" and tokens["eos"] == references[0][: eos_at + 1]
    assert final["stop"].finish_reason == "stop" and final["stop"].text == tok.decode(ref)[:first]
    assert tokens["stop"] == ref[: first + len(stop_text)]
    assert not engine.abort("eos")  # finished requests cannot be aborted


def test_waiting_request_can_be_aborted_and_ids_are_reusable(target, draft, prompts):
    engine = engine_for(target, draft, "ngram", "chain4", max_batch=1)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=5))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=5))
    engine.step()
    assert engine.abort("b")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished][0] == ("b", "abort")
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=3))
    assert len(engine.generate([prompts[2]], SamplingParams(max_tokens=3))[0]) == 3


def test_the_draft_model_catches_up_a_long_row_beside_a_new_one(draft):
    """A row near the end of its positions and a new row with a whole prompt to feed run one
    catch-up pass, every row padded to the longest: the pads must fit the draft's cache."""
    drafter = DraftModelDrafter(draft, rows=2, max_len=64, max_expanded_nodes=8)
    shape = TreeShape((2, 1))
    long_row = [(7 * i) % 50 + 1 for i in range(60)]
    drafter.propose([long_row], shape)  # row 0's cache now holds 60 tokens
    new_row = [(3 * i) % 40 + 1 for i in range(50)]
    trees = drafter.propose([long_row + [5], new_row], shape)
    assert [len(t) for t in trees] == [4, 4] and drafter.cached == [61, 50]
