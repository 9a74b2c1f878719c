"""CUDA graphs for every (batch size, k) a live policy may run (issue 49, item 3), checked
with vLLM 0.32's own code and no GPU: the GPU configs' engine arguments built as the app
builder builds them, vLLM's VllmConfig and CompilationConfig resolving capture sizes and the
CUDA-graph mode as they do on CUDA, and each model runner's own graph bookkeeping (V1's
CudagraphDispatcher, V2's CudaGraphManager) answering, for every batch size and k, which
graph the step would run. What vLLM does and why adaspec starts it this way:
serve_app/vllm_cudagraphs.py and docs/configuration.md ("CUDA graphs").
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve_app.builder import llm_config
from serve_app.config import AppConfig
from serve_app.vllm_cudagraphs import START_POLICY_ENV, capture_sizes, capture_table, request_counts

REPO = Path(__file__).resolve().parents[1]
GPU_CONFIGS = ["app-gpu-tp2.yaml", "app-gpu-eagle3.yaml"]
# vLLM 0.32's default max_num_batched_tokens on GPUs (EngineArgs.get_batch_defaults): 2048 for an
# OpenAI server below 70 GiB (A100, L40S), 8192 on H100/H200, 16384 from 160 GiB (B200). A
# uniform decode step of more tokens cannot be scheduled, so it needs no graph.
GPU_BATCHED_TOKENS = [2048, 8192, 16384]
# The tiny Llama of testkit/vllm_scheduler.py: vLLM reads config.json only (no weights). The
# graphs depend on the scheduler and speculative settings, not on the model.
_TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
               "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "intermediate_size": 128, "max_position_embeddings": 8192, "torch_dtype": "float32"}


@dataclass(frozen=True)
class Graphs:
    """Which graph each uniform decode step (batch b, k drafts) runs in one engine."""

    v2: bool                    # Model Runner V2 (else V1)
    mode: str                   # the resolved CUDAGraphMode, e.g. "FULL_AND_PIECEWISE"
    sizes: tuple[int, ...]      # compilation_config.cudagraph_capture_sizes after vLLM resolved them
    step_mode: dict             # (b, k) -> "FULL" | "PIECEWISE" | "NONE" (eager)
    draft_ks: frozenset[int]    # V2: k values whose multi-step drafting graphs the EAGLE drafter captures


def _vllm_config(tmp_path: Path, engine_kwargs: dict, max_num_batched_tokens: int):
    """vLLM's VllmConfig from the builder's engine arguments, on this CPU. The drafter is n-gram
    (a draft model or head would need its weights' config from the hub): which graphs are
    captured depends on num_speculative_tokens and the table, not on the method."""
    from vllm.config import CompilationConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig

    (tmp_path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    spec = engine_kwargs["speculative_config"]
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32",
                        max_model_len=engine_kwargs["max_model_len"])
    scheduler = SchedulerConfig(max_num_seqs=engine_kwargs["max_num_seqs"],
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=engine_kwargs["max_model_len"], enable_chunked_prefill=True,
                                is_encoder_decoder=False)
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=spec["num_speculative_tokens"],
                                    prompt_lookup_min=2, prompt_lookup_max=4,
                                    num_speculative_tokens_per_batch_size=spec["num_speculative_tokens_per_batch_size"])
    # CompilationConfig(**...) also checks that every key the builder passes is vLLM's.
    compilation = CompilationConfig(**engine_kwargs.get("compilation_config", {}))
    return VllmConfig(model_config=model, scheduler_config=scheduler, speculative_config=speculative,
                      compilation_config=compilation), engine_kwargs.get("compilation_config", {})


def resolve_graphs(tmp_path: Path, monkeypatch, engine_kwargs: dict, env: dict[str, str],
                   max_num_batched_tokens: int) -> Graphs:
    """The graphs a CUDA engine started with `engine_kwargs` (and the replica's `env`) captures.

    VllmConfig is built on this CPU, whose platform turns CUDA graphs off; the CUDA path is then
    replayed with vLLM's own methods in the order VllmConfig.__post_init__ and the model runner
    call them: the optimization level's cudagraph_mode (O2, vLLM's default), the dynamic-k
    override for V1, the capture sizes, the mode resolved against FlashAttention's support
    (UNIFORM_BATCH: FA2; FA3 supports ALWAYS, which resolves alike here)."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    # Built as V1: VllmConfig refuses V2 without Triton, which this CPU build lacks.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config, given = _vllm_config(tmp_path, engine_kwargs, max_num_batched_tokens)
    # Then the runner the replica's environment picks; unset, vLLM's default on CUDA with
    # Triton is V2 (pinned by tests/test_vllm_contract.py).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env.get("VLLM_USE_V2_MODEL_RUNNER", "1"))
    cc = config.compilation_config
    cc.cudagraph_mode = OPTIMIZATION_LEVEL_TO_CONFIG[config.optimization_level]["compilation_config"]["cudagraph_mode"]
    cc.cudagraph_capture_sizes = given.get("cudagraph_capture_sizes")  # the CPU platform cleared them
    cc.max_cudagraph_capture_size = given.get("max_cudagraph_capture_size")
    cc.mode = CompilationMode.VLLM_COMPILE  # CUDA's; the CPU platform traces once instead
    cc.splitting_ops = None
    cc.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    config.model_config.enforce_eager = False
    config._maybe_override_dynamic_sd_cudagraph_mode()
    config._set_cudagraph_sizes()
    v2 = config.use_v2_model_runner
    mode = cc.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.UNIFORM_BATCH, "FLASH_ATTN",
                                               config.uniform_decode_query_len, use_v2_model_runner=v2)
    max_num_seqs = config.scheduler_config.max_num_seqs
    max_k = config.num_speculative_tokens
    steps = [(b, k) for k in range(max_k + 1) for b in range(1, max_num_seqs + 1)
             if b * (1 + k) <= max_num_batched_tokens]
    if v2:
        step_mode = _v2_step_modes(monkeypatch, config, mode, steps)
        dense = build_dynamic_sd_schedule_lookup(config.speculative_config.num_speculative_tokens_per_batch_size,
                                                 vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=max_k)
        draft_ks = frozenset(set(dense[1:]) - {0, 1})  # SpeculatorCudaGraphManager.capture's set
    else:
        step_mode = _v1_step_modes(config, mode, steps)
        draft_ks = frozenset()
    return Graphs(v2=v2, mode=mode.name, sizes=tuple(cc.cudagraph_capture_sizes), step_mode=step_mode,
                  draft_ks=draft_ks)


def _v1_step_modes(config, mode, steps) -> dict:
    """V1: the runner's CudagraphDispatcher keys, and its dispatch of each uniform decode step
    (uniform in V1's sense only at 1 + max_k tokens a request)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    dispatcher = CudagraphDispatcher(config)
    q_max = config.uniform_decode_query_len
    dispatcher.initialize_cudagraph_keys(mode, q_max)
    return {(b, k): dispatcher.dispatch(b * (1 + k), uniform_decode=(1 + k == q_max))[0].name for b, k in steps}


def _v2_step_modes(monkeypatch, config, mode, steps) -> dict:
    """V2: the target model's CudaGraphManager (built as ModelCudaGraphManager's parent, with
    the pipeline group and graph pool of a single GPU stubbed), and its dispatch of each
    uniform decode step as GPUModelRunner.execute_model asks it."""
    from vllm.v1.worker.gpu import cudagraph_utils

    monkeypatch.setattr(cudagraph_utils, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True,
                                                                                  is_last_rank=True))
    monkeypatch.setattr(type(cudagraph_utils.current_platform), "get_global_graph_pool", lambda self: None)
    manager = cudagraph_utils.CudaGraphManager(config, device=None, cudagraph_mode=mode,
                                               decode_query_len=config.uniform_decode_query_len)
    manager._graphs_captured = True  # what capture() sets once every graph is captured
    out = {}
    for b, k in steps:
        desc = manager.dispatch(b, b * (1 + k), 1 + k, 0, max_query_len=1 + k)
        out[(b, k)] = desc.cg_mode.name
    return out


def _builder_engine(config_name: str, **changes) -> tuple[dict, dict[str, str]]:
    cfg = AppConfig.from_yaml(str(REPO / "configs" / config_name))
    if changes:
        cfg = AppConfig.model_validate({**cfg.model_dump(), **changes})
    config = llm_config(cfg)
    return config.engine_kwargs, config.runtime_env["env_vars"]


# ---------------------------------------------------------------------- the shipped GPU configs
@pytest.mark.parametrize("tokens", GPU_BATCHED_TOKENS)
@pytest.mark.parametrize("config_name", GPU_CONFIGS)
def test_every_batch_size_and_k_runs_a_captured_graph(config_name, tokens, tmp_path, monkeypatch):
    """No uniform decode step the controller may choose (every batch size up to max_num_seqs,
    every k of 0..max_k, within the token budget) runs eager; on V2 every k has full graphs."""
    engine_kwargs, env = _builder_engine(config_name)
    graphs = resolve_graphs(tmp_path, monkeypatch, engine_kwargs, env, tokens)
    max_num_seqs = engine_kwargs["max_num_seqs"]
    max_k = engine_kwargs["speculative_config"]["num_speculative_tokens"]
    # vLLM keeps adaspec's sizes as given, but those above the token budget: no rounding to
    # multiples of 1 + max_k (that applies to V1 with full decode graphs only).
    given = engine_kwargs["compilation_config"]["cudagraph_capture_sizes"]
    assert graphs.sizes == tuple(s for s in given if s <= tokens)
    eager = sorted(step for step, m in graphs.step_mode.items() if m == "NONE")
    assert not eager, f"{config_name}: {len(eager)} (batch, k) steps run eager, e.g. {eager[:5]}"
    if not graphs.v2:
        # V1 under a per-batch-size k: piecewise graphs only, keyed by token count.
        assert graphs.mode == "PIECEWISE" and set(graphs.step_mode.values()) == {"PIECEWISE"}
        return
    assert graphs.mode == "FULL_AND_PIECEWISE"
    # Every batch size of vLLM's request grid runs a full graph at every k, and the EAGLE
    # drafter captures its multi-step drafting graphs for every k that drafts more than once.
    for k in range(max_k + 1):
        for b in request_counts(max_num_seqs):
            if b * (1 + k) <= tokens:
                assert graphs.step_mode[(b, k)] == "FULL", (config_name, b, k)
    assert graphs.draft_ks == frozenset(range(2, max_k + 1))


def test_the_builder_passes_the_capture_sizes_and_table_it_documents():
    engine_kwargs, env = _builder_engine("app-gpu-eagle3.yaml")
    spec = engine_kwargs["speculative_config"]
    assert spec["num_speculative_tokens_per_batch_size"] == capture_table(256, 8)
    assert engine_kwargs["compilation_config"] == {"cudagraph_capture_sizes": capture_sizes(256, 8)}
    assert len(capture_sizes(256, 8)) == 165 and capture_sizes(256, 8)[-1] == 256 * 9
    # The start policy travels beside the table, in the replica's environment.
    assert env[START_POLICY_ENV] == "1-4:chain6,5-16:chain4,17-64:chain2,65+:off"
    # On CPU vLLM captures no graphs: no compilation_config.
    cpu_kwargs, cpu_env = _builder_engine("app-gpu-eagle3.yaml", accelerator="cpu", tensor_parallel_size=1)
    assert "compilation_config" not in cpu_kwargs and START_POLICY_ENV in cpu_env


def test_a_compilation_config_in_engine_kwargs_is_kept():
    own = {"cudagraph_capture_sizes": [1, 2, 4]}
    kwargs, _ = _builder_engine("app-gpu-eagle3.yaml", engine_kwargs={"compilation_config": own})
    assert kwargs["compilation_config"] == own
    kwargs, _ = _builder_engine("app-gpu-eagle3.yaml", engine_kwargs={"compilation_config": {"mode": 3},
                                                                      "max_num_batched_tokens": 1024})
    assert kwargs["compilation_config"] == {"mode": 3, "cudagraph_capture_sizes": capture_sizes(256, 8, 1024)}
    assert max(kwargs["compilation_config"]["cudagraph_capture_sizes"]) <= 1024


def test_vllm_alone_captures_the_start_policys_k_only(tmp_path, monkeypatch):
    """Why adaspec sets both: started as before (the start policy as vLLM's table, vLLM's own
    capture sizes), the EAGLE-3 app's V2 engine has full graphs only for the start policy's k
    (0, 2, 4, 6), drafting graphs only for k 2, 4 and 6, and nothing above 512 tokens."""
    engine_kwargs, env = _builder_engine("app-gpu-eagle3.yaml")
    policy = AppConfig.from_yaml(str(REPO / "configs" / "app-gpu-eagle3.yaml")).speculation.initial_policy()
    plain = {**engine_kwargs, "speculative_config": {**engine_kwargs["speculative_config"],
                                                     "num_speculative_tokens_per_batch_size":
                                                         policy.to_vllm_table(engine_kwargs["max_num_seqs"])}}
    del plain["compilation_config"]
    graphs = resolve_graphs(tmp_path, monkeypatch, plain, env, 8192)
    assert graphs.v2 and graphs.sizes[-1] == 512
    full_ks = {k for (b, k), m in graphs.step_mode.items() if m == "FULL"}
    assert full_ks == {0, 2, 4, 6}
    assert graphs.draft_ks == {2, 4, 6}
    eager = [step for step, m in graphs.step_mode.items() if m == "NONE"]
    assert eager and all(b * (1 + k) > 512 for b, k in eager)


# ---------------------------------------------------------------------- the capture table
@pytest.mark.parametrize("max_num_seqs,max_k", [(256, 8), (64, 4), (9, 8), (2, 1), (300, 16)])
def test_the_capture_table_holds_every_k_vllm_reads(max_num_seqs, max_k):
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    dense = build_dynamic_sd_schedule_lookup(capture_table(max_num_seqs, max_k), vllm_max_batch_size=max_num_seqs,
                                             vllm_num_speculative_tokens=max_k)
    assert set(dense[1:]) == set(range(max_k + 1))


def test_with_fewer_batch_sizes_than_k_values_the_largest_k_are_kept():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    dense = build_dynamic_sd_schedule_lookup(capture_table(3, 8), vllm_max_batch_size=3, vllm_num_speculative_tokens=8)
    assert dense[1:] == [8, 7, 6]


def test_vllm_reads_the_graphs_k_values_from_the_start_table():
    """The vLLM 0.32 code this module works around: V2's target and drafter graphs take their
    k values from num_speculative_tokens_per_batch_size, and so do the default capture sizes.
    When one of these no longer reads the table, revisit serve_app/vllm_cudagraphs.py."""
    from vllm.config.vllm import VllmConfig
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    for func in (CudaGraphManager._init_candidates, SpeculatorCudaGraphManager.capture,
                 VllmConfig._set_cudagraph_sizes):
        source = inspect.getsource(func)
        assert "build_dynamic_sd_schedule_lookup" in source and "num_speculative_tokens_per_batch_size" in source, (
            f"{func.__qualname__} no longer builds its k values from the start table")


# ---------------------------------------------------------------------- the start policy
def test_the_scheduler_starts_with_the_configured_policy_not_the_capture_table(monkeypatch):
    from serve_app.vllm_scheduler import AdaspecScheduler
    from testkit.vllm_scheduler import build, vllm_config

    table = capture_table(8, 4)
    monkeypatch.setenv(START_POLICY_ENV, "1-2:chain3,3+:off")
    scheduler = build(AdaspecScheduler, vllm_config(table, async_scheduling=False, max_num_seqs=8))
    assert str(scheduler._slot.policy) == "1-2:chain3,3+:off"
    assert scheduler.dynamic_sd_lookup[1:] == [3, 3, 0, 0, 0, 0, 0, 0]
    # Without the policy, the capture table is refused rather than served.
    monkeypatch.delenv(START_POLICY_ENV)
    with pytest.raises(RuntimeError, match=START_POLICY_ENV):
        build(AdaspecScheduler, vllm_config(table, async_scheduling=True, max_num_seqs=8))
    # A vLLM engine started by hand with a table of its own starts from that table.
    own = build(AdaspecScheduler, vllm_config([[1, 4, 2], [5, 8, 1]], async_scheduling=False, max_num_seqs=8))
    assert str(own._slot.policy) == "1-4:chain2,5+:chain1"
    assert os.environ.get(START_POLICY_ENV) is None
