"""The native engine on the real embedded model (SmolLM2-135M-Instruct, fp32): its greedy text,
and token-for-token equality of every speculation shape with the model's own cache-free greedy
decoding, with a second request joining mid-run. One model load shared by the module; in
bfloat16 (a second load), greedy output under speculation equals `off`'s at batch 1 and 2."""

from __future__ import annotations

import pytest
import torch

from adaspec.models import ModelError
from prepare.datasets import load_prompts
from prepare.models import resolve_model
from adaspec.policy import SpecPolicy
from native_engine import cpu_kernels, dtype_choice
from native_engine.drafters import NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.cpu_linear import CpuLinear
from native_engine.requests import SamplingParams
from native_engine.testing import reference_greedy

MODEL = "smollm2-135m-instruct"
# The second prompt invites copying, so n-gram drafts get accepted (and rejected).
PROMPTS = ["The capital of France is", "The cat sat on the mat. The dog sat on the rug. The cat sat on the"]
MAX_TOKENS = 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smol():
    try:
        resolve_model(MODEL, prepare=False)
    except ModelError as e:
        pytest.skip(f"{e}")
    torch.set_num_threads(1)
    return NativeEngine.from_pretrained(MODEL, config=EngineConfig(max_batch_size=2, max_seq_len=160))


@pytest.fixture(scope="module")
def references(smol):
    ids = [smol.tokenizer.encode(p).ids for p in PROMPTS]
    return ids, [reference_greedy(smol.model, p, MAX_TOKENS, tuple(smol.eos_ids)) for p in ids]


def test_greedy_text_is_paris(smol):
    out = smol.generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0]
    assert smol.tokenizer.decode(out).startswith(" Paris.")


@pytest.mark.parametrize("shape", ["off", "chain4", "tree4x2x2x1", "tree4x2x2x1@12"])
def test_every_shape_reproduces_greedy_decoding(smol, references, shape):
    name, _, budget = shape.partition("@")
    engine = NativeEngine(smol.model, NgramDrafter(),
                          EngineConfig(max_batch_size=2, max_seq_len=160, tree_budget=int(budget) if budget else None),
                          SpecPolicy.parse(name), smol.tokenizer, tuple(smol.eos_ids))
    ids, refs = references
    outputs = {"0": [], "1": []}
    engine.add_request("0", ids[0], SamplingParams(max_tokens=MAX_TOKENS))
    step = 0
    while engine.has_unfinished() or step < 3:
        if step == 3:  # the second request joins a running batch
            engine.add_request("1", ids[1], SamplingParams(max_tokens=MAX_TOKENS))
        for o in engine.step():
            outputs[o.request_id].extend(o.new_token_ids)
        step += 1
    assert outputs["0"] == refs[0]
    assert outputs["1"] == refs[1]
    steps = engine.drain().steps
    assert all(str(s.config) == name for s in steps)
    if name != "off":  # the second prompt repeats itself: n-gram drafts must land
        assert sum(sum(s.accepted_per_pos) for s in steps) > 0


@pytest.fixture(scope="module")
def smol_bf16(smol):
    return NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16, config=EngineConfig(max_batch_size=2, max_seq_len=512))


# Without oneDNN bfloat16 (an AVX2-only CPU) bf16 is slow and `dtype: auto` serves float32; there
# torch's bf16 attention flipped a near-tie under speculation before adaspec's kernels took bf16
# passes, and this has not been run on such a CPU since (docs/native-engine.md, "Greedy output
# under speculation equals off's in bf16 too").
@pytest.mark.skipif(not dtype_choice.cpu_has_bf16(), reason="this CPU has no oneDNN bfloat16 (see the comment)")
@pytest.mark.parametrize("batch", [1, 2])
def test_bfloat16_greedy_under_speculation_equals_off(smol_bf16, batch):
    """bf16 rounds every layer's output, so a token whose logits are summed in another order
    in a verify pass than in a one-token pass can flip a near-tie of the logits. Every pass
    takes one matmul path (linear_choice.one_path) and attends with adaspec's kernels, whose
    sums per row do not depend on the pass. HumanEval prompts (125-160 tokens) that copy
    their own code: drafts are accepted deep into their trees."""
    prompts = [p.text for p in load_prompts("humaneval", None, seed=None)[:3]]

    def run(policy: str) -> tuple[list[list[int]], int]:
        engine = NativeEngine(smol_bf16.model, NgramDrafter(), EngineConfig(max_batch_size=batch, max_seq_len=512),
                              SpecPolicy.parse(policy), smol_bf16.tokenizer, tuple(smol_bf16.eos_ids))
        outputs = engine.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
        return outputs, sum(sum(s.accepted_per_pos) for s in engine.drain().steps)

    if cpu_kernels.load():  # decode steps and verify passes attend with adaspec's kernels, over a float32 cache
        assert smol_bf16.cache.k.dtype == torch.float32
    # one matmul path for every decode step and verify pass (native_engine/linear_choice.py, one_path)
    assert len({path for m in smol_bf16.model.modules() if isinstance(m, CpuLinear) for path in m.route}) == 1
    off, _ = run("off")
    for policy in ("chain4", "tree4x2x2x1"):
        outputs, accepted = run(policy)
        assert accepted > 0, policy
        for i, (out, ref) in enumerate(zip(outputs, off)):
            first = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), None)
            assert out == ref, f"{policy}: prompt {i} differs from off at token {first}"


@pytest.mark.skipif(not dtype_choice.cpu_has_bf16() or not cpu_kernels.load(),
                    reason="this CPU has no oneDNN bfloat16 or adaspec's kernels did not build")
def test_compiled_bfloat16_greedy_under_speculation_equals_compiled_off():
    """Compiled, the one-token graph and the batch-1 verify graph must give a token the same
    bits too: inductor rounds where eager rounds in reduced precision (compiled_decode.compile_decode;
    without it chain4 left `off`'s tokens at token 29 of the third prompt)."""
    engine = NativeEngine.from_pretrained(MODEL, dtype=torch.bfloat16,
                                          config=EngineConfig(max_batch_size=1, max_seq_len=512))
    engine.compile_decode()
    prompts = [p.text for p in load_prompts("humaneval", None, seed=None)[:3]]

    def run(policy: str) -> list[list[int]]:
        runner = NativeEngine(engine.model, NgramDrafter(), EngineConfig(max_batch_size=1, max_seq_len=512),
                              SpecPolicy.parse(policy), engine.tokenizer, tuple(engine.eos_ids))
        return runner.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))

    off = run("off")
    for i, (out, ref) in enumerate(zip(run("chain4"), off)):
        first = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        assert out == ref, f"chain4: prompt {i} differs from off at token {first}"
