"""Serving the native engine without Ray (issue 6, phase 2): config checks, the engine
thread, incremental text, and that the controller only proposes what the engine runs.
The real stack is in tests/test_native_serving.py."""

from __future__ import annotations

import concurrent.futures

import pytest
import yaml
from pydantic import ValidationError

from adaspec.policy import SpecPolicy
from cli.serve_config import check_serve_config
from controller.policy_search import candidate_configs
from native_engine.drafters import NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.model import build_model
from native_engine.requests import SamplingParams
from native_engine.testing import tiny_args
from serve_app.config import AppConfig
from serve_app.native_loop import EngineLoop
from serve_app.native_openai import IncrementalText
from testkit.serve_process import REPO

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(max_batch: int = 3, policy: str = "1-2:tree4x2x2,3+:chain2") -> NativeEngine:
    model = build_model(tiny_args(), seed=0)
    return NativeEngine(model, NgramDrafter(max_depth=4), EngineConfig(max_batch_size=max_batch, max_seq_len=160),
                        SpecPolicy.parse(policy))


# ----------------------------------------------------------------------------------- config
def test_tree_app_config_validates():
    check_serve_config(REPO / "configs" / "app-tree.yaml")
    cfg = AppConfig.from_yaml(str(REPO / "configs" / "app-tree.yaml"))
    assert cfg.engine == "native" and cfg.controller.enabled and cfg.admin.enabled and cfg.compile_decode


@pytest.mark.parametrize("override,field", [
    ({"accelerator": "gpu", "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"dtype": "float16"}, "dtype"),
    ({"kv_cache_gib": 2}, "kv_cache_gib"),
    ({"engine_kwargs": {"enforce_eager": True}}, "engine_kwargs"),
])
def test_native_rejects_what_it_cannot_honour_naming_the_field(override, field):
    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate({"engine": "native", **override})


@pytest.mark.parametrize("field,value", [("tree_budget", 8), ("compile_decode", True)])
def test_native_only_fields_need_the_native_engine(field, value):
    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate({"engine": "vllm", field: value})
    cfg = AppConfig.model_validate({"engine": "native", field: value})
    assert getattr(cfg, field) == value

    from serve_app.builder import native_settings
    assert getattr(native_settings(cfg), field) == value


def test_compile_autotune_needs_compile_decode_and_reaches_the_replica():
    with pytest.raises(ValidationError, match="compile_autotune"):
        AppConfig.model_validate({"engine": "native", "compile_autotune": True})
    cfg = AppConfig.model_validate({"engine": "native", "compile_decode": True, "compile_autotune": True})
    from serve_app.builder import native_settings
    assert native_settings(cfg).compile_autotune


def test_tree_app_builds_native_replicas_on_one_cpu_bundle():
    from serve_app.builder import build_app, llm_config, native_settings

    doc = yaml.safe_load((REPO / "configs" / "app-tree.yaml").read_text())
    cfg = AppConfig.model_validate(doc["applications"][0]["args"])
    config = llm_config(cfg)
    assert config.placement_group_config == {"bundles": [{"CPU": 1}]}
    assert config.deployment_config["ray_actor_options"]["num_cpus"] == 0
    settings = native_settings(cfg)
    assert settings.max_batch_size == cfg.max_num_seqs and settings.max_model_len == cfg.max_model_len
    app = build_app(cfg.model_dump())
    (replicas,) = app._bound_deployment.init_kwargs["llm_deployments"].values()
    assert replicas._bound_deployment.init_kwargs["engine_cls"].keywords["settings"] == settings


@pytest.mark.parametrize("native_bf16", [False, True])
def test_bfloat16_on_a_cpu_without_it_is_warned_about(monkeypatch, caplog, native_bf16):
    from native_engine import dtype_choice
    from serve_app.builder import native_settings
    from serve_app.native_adapter import build_engine

    monkeypatch.setattr(dtype_choice, "cpu_has_bf16", lambda: native_bf16)
    settings = native_settings(AppConfig.model_validate({"engine": "native", "dtype": "bfloat16"}))
    with caplog.at_level("WARNING", logger="ray.serve"):
        engine = build_engine(settings)
    assert str(engine.model.lm_head.weight.dtype) == "torch.bfloat16"
    warned = [r.getMessage() for r in caplog.records if "without native bfloat16" in r.getMessage()]
    assert bool(warned) != native_bf16, warned


# ----------------------------------------------------------------------------------- engine thread
def test_engine_loop_serves_requests_like_generate_and_aborts():
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5], [9, 8, 7, 6]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = _engine().generate(prompts, params)
    loop = EngineLoop(_engine(), torch_threads=1)
    loop.start()
    try:
        done = {i: concurrent.futures.Future() for i in range(len(prompts))}
        tokens: dict[int, list[int]] = {i: [] for i in done}

        def sink_for(i):
            def sink(out):
                tokens[i].extend(out.new_token_ids)
                if out.finished:
                    done[i].set_result(out)
            return sink

        for i, prompt in enumerate(prompts):
            loop.submit(f"r{i}", prompt, params, sink_for(i)).result(10)
        outs = [done[i].result(60) for i in done]
        assert [tokens[i] for i in done] == expected
        assert all(o.finish_reason == "length" for o in outs)

        # Refused requests fail their submit; policies and drains run between steps.
        with pytest.raises(ValueError, match="max_seq_len"):
            loop.submit("big", [1] * 100, SamplingParams(max_tokens=100), lambda out: None).result(10)
        ack = loop.call(lambda e: e.apply_policy(SpecPolicy.parse("1+:tree8x8x8", version=3))).result(10)
        assert ack.status == "rejected" and "max_tree_nodes" in ack.message
        steps = loop.call(lambda e: e.drain().steps).result(10)
        assert any(str(s.config) == "tree4x2x2" and s.reached_per_depth_rank for s in steps)

        aborted = concurrent.futures.Future()
        loop.submit("long", [1, 2, 3], SamplingParams(max_tokens=80, ignore_eos=True),
                    lambda out: out.finished and aborted.set_result(out)).result(10)
        loop.abort("long")
        assert aborted.result(30).finish_reason == "abort"
        assert loop.healthy
    finally:
        loop.stop()
    assert not loop.healthy


def test_engine_failure_fails_open_requests_and_health():
    engine = _engine()
    loop = EngineLoop(engine, torch_threads=1)

    def broken_step():
        raise RuntimeError("boom")

    engine.step = broken_step
    loop.start()
    failed = concurrent.futures.Future()
    loop.submit("r", [1, 2, 3], SamplingParams(max_tokens=4), failed.set_result).result(10)
    assert isinstance(failed.result(10), RuntimeError)
    assert not loop.healthy
    with pytest.raises(RuntimeError, match="native engine failed"):
        loop.call(lambda e: None).result(10)


# ----------------------------------------------------------------------------------- text and policies
def test_incremental_text_never_sends_half_characters_or_stop_strings():
    text = IncrementalText(stop=("STOP",))
    assert text.delta("ab\ufffd", finished=False) == ""  # the tail could begin a stop string
    assert text.delta("abcdef", finished=False) == "abc"
    assert text.delta("abcdefS", finished=False) == "d"
    assert text.delta("abcdefgh", finished=True) == "efgh"  # finished: the engine cut any stop string
    plain = IncrementalText(stop=())
    assert plain.delta("caf\ufffd", finished=False) == "caf"
    assert plain.delta("café", finished=False) == "é"


def test_every_config_the_controller_proposes_runs_on_the_native_engine():
    engine = _engine(max_batch=8)
    caps = engine.capabilities()
    assert caps.supports_trees and caps.max_k == 4
    configs = candidate_configs(caps.max_k, caps.supports_trees)
    assert any(str(c).startswith("tree") for c in configs)
    for config in configs:
        policy = SpecPolicy.uniform(config)
        engine.validate_policy(policy)  # raises PolicyError if not
