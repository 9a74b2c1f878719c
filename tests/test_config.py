"""App config validation, the app graph the builder makes, the admin guard, and
`adaspec serve` failing fast on a bad config (no engine is started here)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from starlette.requests import Request

from cli.serve_config import ConfigError, check_serve_config
from serve_app.admin_guard import AdminGuard
from serve_app.ray_llm import OpenAIHTTPException
from serve_app.builder import build_app, check_ranks_fit, llm_config
from serve_app.config import AdminConfig, ApiKeySource, AppConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def no_local_ray_left():
    """Building a deployment asks Ray for the runtime context, which starts a local Ray
    instance in this process; stop it so later tests can join the server's cluster."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.parametrize("args,field", [
    ({"speculation": {"max_k": 0}}, "speculation.max_k"),
    ({"speculation": {"policy": "1-2:chain4,5+:off"}}, "speculation.policy"),
    ({"speculation": {"policy": "chain8"}}, "speculation"),
    ({"speculation": {"method": "draft_model"}}, "speculation"),
    ({"max_num_seq": 4}, "max_num_seq"),
    ({"accelerator": "tpu"}, "accelerator"),
    ({"accelerator_type": "A10G"}, "accelerator_type: a GPU type"),  # on cpu
    ({"engine": "native", "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"controller": {"period_s": 0}}, "controller.period_s"),
    ({"speculation": {"policy": "1-2:chain4,3+:auto"}}, "speculation.policy"),  # budgets: native only
])
def test_bad_config_names_the_field(args, field):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate(args)
    assert field.split(".")[0] in str(err.value)
    if "." in field:
        assert field in str(err.value)


def test_per_request_budgets_are_accepted_for_the_native_engine():
    cfg = AppConfig.model_validate({"engine": "native", "speculation": {"policy": "1-2:auto,3+:budget16"}})
    assert str(cfg.speculation.initial_policy()) == "1-2:auto,3+:budget16"


def test_engine_kwargs_are_checked_against_vllm():
    AppConfig(engine_kwargs={"enforce_eager": True}).check_engine_kwargs()
    with pytest.raises(ValueError, match="engine_kwargs.no_such_arg"):
        AppConfig(engine_kwargs={"no_such_arg": 1}).check_engine_kwargs()
    with pytest.raises(ValueError, match="engine_kwargs.scheduler_cls"):
        AppConfig(engine_kwargs={"scheduler_cls": "x.Y"}).check_engine_kwargs()


def test_cpu_app_fits_two_cores_and_starts_with_the_policy():
    cfg = AppConfig.from_yaml(str(REPO / "configs" / "app.yaml"))
    config = llm_config(cfg)
    spec = config.engine_kwargs["speculative_config"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == cfg.speculation.max_k
    # vLLM's table holds every k (its CUDA graphs; serve_app/vllm_cudagraphs.py); the start
    # policy reaches AdaspecScheduler in the environment.
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 4], [2, 2, 3], [3, 3, 2], [4, 4, 1],
                                                              [5, cfg.max_num_seqs, 0]]
    assert config.runtime_env["env_vars"]["ADASPEC_START_POLICY"] == "1+:chain4"
    assert config.engine_kwargs["scheduler_cls"] == "serve_app.vllm_scheduler.AdaspecScheduler"
    assert config.placement_group_config == {"bundles": [{"CPU": 1}]}
    assert config.deployment_config["ray_actor_options"]["num_cpus"] == 0


def test_vllm_cluster_app_runs_one_unbound_thread_per_engine():
    """Two vLLM engines on one 2-core machine: vLLM's own binding would put both on core 0."""
    cfg = AppConfig.from_yaml(str(REPO / "configs" / "app-cluster-vllm.yaml"))
    config = llm_config(cfg)
    assert cfg.engine == "vllm" and cfg.num_replicas == 2
    assert config.runtime_env["env_vars"] == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                              "ADASPEC_START_POLICY": str(cfg.speculation.initial_policy()),
                                              "VLLM_USE_AOT_COMPILE": "0"}  # the compile cache that loads
    assert config.placement_group_config == {"bundles": [{"CPU": 1}]}  # one replica per 1-CPU node
    assert config.deployment_config["ray_actor_options"]["num_cpus"] == 0
    # Without cpu_threads vLLM keeps its own binding.
    assert "VLLM_CPU_OMP_THREADS_BIND" not in llm_config(AppConfig()).runtime_env["env_vars"]


def test_gpu_app_reserves_one_bundle_per_tensor_parallel_gpu():
    cfg = AppConfig.from_yaml(str(REPO / "configs" / "app-gpu-tp2.yaml"))
    config = llm_config(cfg)
    assert config.engine_kwargs["tensor_parallel_size"] == 2
    assert config.placement_group_config["bundles"] == [{"GPU": 1, "CPU": 1}] * 2
    assert config.placement_group_config["strategy"] == "STRICT_PACK"
    assert config.engine_kwargs["speculative_config"]["model"] == "meta-llama/Llama-3.2-1B-Instruct"


def test_cpu_tp2_app_binds_one_core_per_rank_in_a_packed_placement_group():
    cfg = AppConfig.from_yaml(str(REPO / "configs" / "app-tp2-cpu.yaml"))
    cfg.check_tensor_parallel()
    config = llm_config(cfg)
    assert config.engine_kwargs["tensor_parallel_size"] == 2
    assert config.placement_group_config == {"bundles": [{"CPU": 1}] * 2, "strategy": "STRICT_PACK"}
    ranks = config.runtime_env["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert len(ranks) == 2 and not set(ranks[0].split(",")) & set(ranks[1].split(","))  # disjoint cores
    # The draft folder has no tokenizer of its own: its target's is named for vLLM.
    assert Path(config.engine_kwargs["tokenizer"], "tokenizer.json").is_file()


def test_tensor_parallel_size_must_divide_the_attention_heads():
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide the 9 attention heads of model "
                                         r"'smollm2-135m-instruct'; sizes that do: \[1, 3, 9\]"):
        AppConfig(tensor_parallel_size=2).check_tensor_parallel()
    draft = {"method": "draft_model", "draft_model": "smollm2-135m-instruct-draft"}
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the 4 attention heads of "
                                         "speculation.draft_model"):
        AppConfig(tensor_parallel_size=3, speculation=draft).check_tensor_parallel()
    AppConfig(model="smollm2-135m-instruct-draft", tensor_parallel_size=4).check_tensor_parallel()


def test_more_ranks_than_a_node_has_cpus_fail_naming_the_field(monkeypatch):
    import os

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cores = len(os.sched_getaffinity(0))
    check_ranks_fit(AppConfig(tensor_parallel_size=cores))
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {cores + 1} ranks need one node with {cores + 1} CPUs"):
        check_ranks_fit(AppConfig(tensor_parallel_size=cores + 1))


def test_serve_config_that_cannot_split_the_model_fails_before_any_engine_starts(tmp_path):
    doc = yaml.safe_load((REPO / "configs" / "app.yaml").read_text())
    doc["applications"][0]["args"]["tensor_parallel_size"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    res = subprocess.run([str(Path(sys.executable).parent / "adaspec"), "serve", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "args.tensor_parallel_size: 2 does not divide" in res.stderr, res.stderr


def test_build_app_makes_ingress_and_replica_deployments():
    app = build_app(AppConfig.from_yaml(str(REPO / "configs" / "app.yaml")).model_dump())
    ingress = app._bound_deployment
    assert ingress.name == "AdaspecIngress"
    (replicas,) = ingress.init_kwargs["llm_deployments"].values()
    assert replicas._bound_deployment.func_or_class.__name__ == "SpecReplica"


def test_bad_model_name_fails_naming_the_field(tmp_path):
    doc = yaml.safe_load((REPO / "configs" / "app.yaml").read_text())
    doc["applications"][0]["args"]["model"] = "smollm2-135m-instrct"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"args\.model: 'smollm2-135m-instrct' is not an embedded model"):
        check_serve_config(bad)
    res = subprocess.run([str(Path(sys.executable).parent / "adaspec"), "serve", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "args.model" in res.stderr


@pytest.mark.parametrize("preset, expected", [(None, "0"), ("5", "5")], ids=["default", "user-set"])
def test_adaspec_serve_starts_ray_with_its_workers_at_normal_priority(monkeypatch, preset, expected):
    """`adaspec serve` hands `serve run` RAY_worker_niceness=0 (Ray's default 15 puts the engine
    behind everything else on the node), unless the user set it."""
    from cli import serve

    if preset is None:
        monkeypatch.delenv("RAY_worker_niceness", raising=False)
    else:
        monkeypatch.setenv("RAY_worker_niceness", preset)
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((argv, env)))
    config = str(REPO / "configs" / "app.yaml")
    serve.run(argparse.Namespace(config=config))
    ((argv, env),) = calls
    assert argv[1:] == ["run", config] and env["RAY_worker_niceness"] == expected


def test_serve_config_typo_fails_before_deploying(tmp_path):
    doc = yaml.safe_load((REPO / "configs" / "app.yaml").read_text())
    doc["applications"][0]["args"]["speculation"]["max_kk"] = 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"applications\[adaspec\]\.args\.speculation\.max_kk"):
        check_serve_config(bad)


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "GET", "path": "/admin/status", "headers": raw})


@pytest.mark.parametrize("admin,headers,status", [
    (AdminConfig(enabled=False), {}, 404),
    (AdminConfig(enabled=True, token="s3cret"), {}, 401),
    (AdminConfig(enabled=True, token="s3cret"), {"Authorization": "Bearer wrong"}, 401),
    (AdminConfig(enabled=True, token="s3cret"), {"Authorization": "Bearer s3cret"}, None),
    (AdminConfig(enabled=True), {}, None),
])
def test_admin_routes_are_guarded(admin, headers, status):
    guard = AdminGuard(admin, "127.0.0.1")
    if status is None:
        guard.check(_request(headers))
    else:
        with pytest.raises(OpenAIHTTPException) as err:
            guard.check(_request(headers))
        assert err.value.status_code == status


def test_admin_token_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("ADASPEC_TEST_ADMIN_TOKEN", "from-env")
    guard = AdminGuard(AdminConfig(enabled=True, token_env="ADASPEC_TEST_ADMIN_TOKEN"), "0.0.0.0")
    guard.check(_request({"Authorization": "Bearer from-env"}))
    with pytest.raises(OpenAIHTTPException) as err:
        guard.check(_request({}))
    assert err.value.status_code == 401


@pytest.mark.parametrize("value", [None, ""])
def test_admin_token_variable_unset_fails_at_start(monkeypatch, value):
    # An unset or empty variable must not silently open the routes.
    if value is None:
        monkeypatch.delenv("ADASPEC_TEST_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("ADASPEC_TEST_ADMIN_TOKEN", value)
    admin = AdminConfig(enabled=True, token_env="ADASPEC_TEST_ADMIN_TOKEN")
    with pytest.raises(ValueError, match=r"admin\.token_env: .*ADASPEC_TEST_ADMIN_TOKEN"):
        AdminGuard(admin, "127.0.0.1")
    # Admin routes off: the variable is never read.
    AdminGuard(AdminConfig(enabled=False, token_env="ADASPEC_TEST_ADMIN_TOKEN"), "0.0.0.0")


@pytest.mark.parametrize("host,refused", [
    ("127.0.0.1", False), ("localhost", False), ("::1", False), ("127.0.0.2", False),
    ("0.0.0.0", True), ("10.0.0.5", True), ("::", True), ("my-host.example", True),
])
def test_open_admin_routes_on_a_public_host_refuse_to_start(host, refused):
    open_routes = AdminConfig(enabled=True)
    if refused:
        with pytest.raises(ValueError, match=r"^admin\.token: "):
            AdminGuard(open_routes, host)
    else:
        AdminGuard(open_routes, host)
    AdminGuard(AdminConfig(enabled=True, token="s3cret"), host)  # with a token, anywhere
    AdminGuard(AdminConfig(enabled=False), host)


def test_serve_config_with_open_admin_routes_on_a_public_host_fails_naming_the_token(tmp_path):
    doc = yaml.safe_load((REPO / "configs" / "app.yaml").read_text())
    doc["http_options"]["host"] = "0.0.0.0"
    bad = tmp_path / "public.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"applications\[adaspec\]\.args\.admin\.token: .*'0\.0\.0\.0'"):
        check_serve_config(bad)
    doc["applications"][0]["args"]["admin"]["token_env"] = "ADASPEC_ADMIN_TOKEN"
    bad.write_text(yaml.safe_dump(doc))
    check_serve_config(bad)


@pytest.mark.parametrize("admin", [
    {"token": "s3cret", "token_env": "ADASPEC_ADMIN_TOKEN"},
    {"token_env": "not a name"},
])
def test_admin_token_fields_are_checked(admin):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate({"admin": {"enabled": True, **admin}})
    assert err.value.errors()[0]["loc"][0] == "admin"


@pytest.mark.parametrize("args,field", [
    ({"routing": "round_robin"}, "routing"),
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling"),
    ({"autoscaling": {"min_replicas": 0}}, "autoscaling.min_replicas"),
    ({"autoscaling": {"target_ongoing_requests": 0}}, "autoscaling.target_ongoing_requests"),
    ({"autoscaling": {"max_replica": 3}}, "autoscaling.max_replica"),
    ({"num_replicas": 2, "autoscaling": {"max_replicas": 3}}, "num_replicas"),
])
def test_bad_scaling_or_routing_names_the_field(args, field):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate(args)
    assert field.split(".")[0] in str(err.value)
    if "." in field:
        assert field in str(err.value)


@pytest.mark.parametrize("args,router", [
    ({}, "power_of_two"),
    ({"num_replicas": 2}, "spec_aware"),
    ({"autoscaling": {"max_replicas": 3}}, "spec_aware"),
    ({"autoscaling": {"max_replicas": 1}}, "power_of_two"),
    ({"num_replicas": 2, "routing": "power_of_two"}, "power_of_two"),
    ({"routing": "spec_aware"}, "spec_aware"),
])
def test_spec_aware_routing_is_the_default_with_more_than_one_replica(args, router):
    assert AppConfig.model_validate(args).router == router


def test_replica_deployment_gets_the_router_and_the_replica_count():
    from ray.serve.config import RequestRouterConfig

    from serve_app.builder import ROUTING_MAX_STATS_AGE_S, ROUTING_STATS_PERIOD_S
    from serve_app.router import SpecAwareRouter

    options = llm_config(AppConfig(num_replicas=2)).deployment_config
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    router = options["request_router_config"]
    assert isinstance(router, RequestRouterConfig)
    assert router.request_router_class == "serve_app.router:SpecAwareRouter"
    assert router.request_routing_stats_period_s == ROUTING_STATS_PERIOD_S
    assert router.request_router_kwargs == {"max_stats_age_s": ROUTING_MAX_STATS_AGE_S}
    # What Serve's handle unpickles and constructs (by value, as Serve ships it).
    assert router.get_request_router_class().__name__ == SpecAwareRouter.__name__
    assert "request_router_config" not in llm_config(AppConfig()).deployment_config  # one replica: Serve's own


@pytest.mark.parametrize("engine", ["vllm", "native"])
def test_autoscaling_is_passed_to_serve(engine):
    cfg = AppConfig(engine=engine, max_num_seqs=16, autoscaling={"min_replicas": 1, "max_replicas": 3})
    options = llm_config(cfg).deployment_config
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 16}
    assert options["request_router_config"].request_router_class == "serve_app.router:SpecAwareRouter"


def test_gpu_app_autoscales_behind_the_router():
    cfg = AppConfig.from_yaml(str(REPO / "configs" / "app-gpu-tp2.yaml"))
    options = llm_config(cfg).deployment_config
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64}
    assert "num_replicas" not in options and "request_router_config" in options


def test_build_app_with_autoscaling_and_router():
    args = AppConfig.from_yaml(str(REPO / "configs" / "app.yaml")).model_dump()
    args.update(autoscaling={"min_replicas": 1, "max_replicas": 2}, num_replicas=1)
    replicas = next(iter(build_app(args)._bound_deployment.init_kwargs["llm_deployments"].values()))
    config = replicas._bound_deployment._deployment_config
    assert config.autoscaling_config.max_replicas == 2
    assert config.request_router_config.request_router_class == "serve_app.router:SpecAwareRouter"


def test_suffix_decoding_is_refused_with_the_reason():
    # vLLM 0.32's suffix proposer asserts a fixed k; a live policy's `off` killed the engine.
    with pytest.raises(ValidationError, match="speculation.method\n.*method: suffix is not supported with vLLM 0.32"):
        AppConfig.model_validate({"speculation": {"method": "suffix"}})


# ---------------------------------------------------------------------- drafting methods
EAGLE3_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
TABLE = [[1, 1, 4], [2, 2, 3], [3, 3, 2], [4, 4, 1], [5, 64, 0]]  # every k of 0..4 over max_num_seqs 64

# method's speculation block -> the speculative_config vLLM gets, and the engine's
# VLLM_USE_V2_MODEL_RUNNER on a GPU (None: vLLM's default).
ACCEPTED = [
    ({"method": "ngram"},
     {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}, "0"),
    ({"method": "ngram_gpu", "prompt_lookup_min": 3},
     {"method": "ngram_gpu", "prompt_lookup_min": 3, "prompt_lookup_max": 4}, "1"),
    ({"method": "draft_model", "draft_model": "meta-llama/Llama-3.2-1B-Instruct", "draft_tensor_parallel_size": 1},
     {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct", "draft_tensor_parallel_size": 1}, "0"),
    ({"method": "eagle", "draft_model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"},
     {"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, None),
    ({"method": "eagle3", "draft_model": EAGLE3_HEAD},
     {"method": "eagle3", "model": EAGLE3_HEAD}, None),
    ({"method": "mtp"},  # the target's own MTP layers: vLLM fills `model` with the target
     {"method": "mtp"}, "0"),
    ({"method": "mtp", "draft_model": "org/mtp-head"},
     {"method": "mtp", "model": "org/mtp-head"}, "0"),
    ({"method": "custom_class", "proposer_class": "my_pkg.drafters.MyProposer"},
     {"method": "custom_class", "model": "my_pkg.drafters.MyProposer"}, "0"),
]


@pytest.mark.parametrize("spec,expected,v2", ACCEPTED, ids=[f"{a['method']}-{i}" for i, (a, _, _) in enumerate(ACCEPTED)])
def test_each_accepted_method_builds_the_speculative_config_vllm_gets(spec, expected, v2):
    import dataclasses

    from vllm.config import SpeculativeConfig

    cfg = AppConfig.model_validate({"accelerator": "gpu", "speculation": spec})
    config = llm_config(cfg)
    got = config.engine_kwargs["speculative_config"]
    assert got == {**expected, "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": TABLE}
    # Every key is a field of vLLM's own SpeculativeConfig: nothing it would reject by name.
    assert set(got) <= {f.name for f in dataclasses.fields(SpeculativeConfig)}
    env = config.runtime_env["env_vars"]
    assert env.get("VLLM_USE_V2_MODEL_RUNNER") == v2


@pytest.mark.parametrize("method,reason", [
    ("suffix", "proposes a variable number of tokens per request"),
    ("medusa", "asserts that the step's k equals the configured one"),
    ("mlp_speculator", "neither model runner builds a proposer"),
    ("dflash", "whole block of positions in one parallel pass"),
    ("dspark", "chooses how many drafts to verify itself"),
    ("extract_hidden_states", "is not a drafter"),
    ("deepseek_mtp", "vLLM 0.32 renames deepseek_mtp to mtp"),
    ("qwen3_next_mtp", "write `method: mtp`"),
    ("lookahead", "Input should be 'ngram', 'ngram_gpu', 'draft_model', 'eagle', 'eagle3', 'mtp' or 'custom_class'"),
])
def test_refused_methods_fail_at_start_naming_the_field_and_the_reason(method, reason):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate({"accelerator": "gpu", "speculation": {"method": method}})
    assert "speculation.method\n" in str(err.value) and reason in str(err.value)


@pytest.mark.parametrize("args,field,reason", [
    ({"speculation": {"method": "eagle3"}}, "speculation.draft_model", EAGLE3_HEAD),
    ({"speculation": {"method": "eagle"}}, "speculation.draft_model", "needs the head's weights"),
    ({"speculation": {"method": "draft_model"}}, "speculation.draft_model", "needs a draft model"),
    ({"speculation": {"method": "ngram", "draft_model": "x/y"}}, "speculation.draft_model", "drafts without a model"),
    ({"speculation": {"method": "custom_class"}}, "speculation.proposer_class", "import path"),
    ({"speculation": {"method": "ngram", "proposer_class": "a.B"}}, "speculation.proposer_class", "exactly when"),
    ({"speculation": {"method": "custom_class", "proposer_class": "org/repo"}}, "speculation.proposer_class",
     "should match pattern"),
    ({"speculation": {"method": "ngram", "draft_tensor_parallel_size": 1}}, "speculation.draft_tensor_parallel_size",
     "no draft model"),
    ({"tensor_parallel_size": 4, "speculation": {"method": "eagle3", "draft_model": EAGLE3_HEAD,
                                                 "draft_tensor_parallel_size": 2}},
     "speculation.draft_tensor_parallel_size", "over 1 rank or over the target's 4"),
    ({"accelerator": "cpu", "speculation": {"method": "ngram_gpu"}}, "speculation.method", "accelerator gpu only"),
    ({"engine": "native", "speculation": {"method": "eagle3", "draft_model": EAGLE3_HEAD}}, "speculation.method",
     "engine native drafts with ngram or draft_model"),
])
def test_what_each_method_needs_is_checked_naming_the_field(args, field, reason):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate({"accelerator": "gpu", **args})
    assert field in str(err.value) and reason in str(err.value)


def test_a_drafter_on_one_rank_need_not_divide_by_the_targets_ranks():
    # The 4-head model split 4 ways, drafted by the 9-head one: on 4 ranks it cannot split, on 1 it need not.
    draft = {"method": "draft_model", "draft_model": "smollm2-135m-instruct"}
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide the 9 attention heads of "
                                         "speculation.draft_model"):
        AppConfig(model="smollm2-135m-instruct-draft", tensor_parallel_size=4, speculation=draft).check_tensor_parallel()
    one = {**draft, "draft_tensor_parallel_size": 1}
    AppConfig(model="smollm2-135m-instruct-draft", tensor_parallel_size=4, speculation=one).check_tensor_parallel()


@pytest.mark.parametrize("config,v2", [("app-gpu-tp2.yaml", "0"), ("app-gpu-eagle3.yaml", None)])
def test_gpu_configs_pick_the_model_runner_that_drafts_the_live_k(config, v2):
    """V2's draft-model speculator drafts max_k every step (serve_app/builder.py,
    V2_MODEL_RUNNER_ENV): the draft-model app runs V1; the EAGLE-3 app keeps vLLM's default
    (V2 on CUDA), whose EAGLE speculator drafts the step's k."""
    cfg = AppConfig.from_yaml(str(REPO / "configs" / config))
    assert llm_config(cfg).runtime_env["env_vars"].get("VLLM_USE_V2_MODEL_RUNNER") == v2
    # On CPU vLLM has no Triton backend and always runs V1: nothing to set.
    cpu = AppConfig.model_validate({**cfg.model_dump(), "accelerator": "cpu", "tensor_parallel_size": 1})
    assert "VLLM_USE_V2_MODEL_RUNNER" not in llm_config(cpu).runtime_env["env_vars"]


# The OpenAI routes' API key (serve_app/api_key.py; the request-level checks are in
# tests/test_request_checks.py).
@pytest.mark.parametrize("args,field", [
    ({"api_key": "s3cret", "api_key_env": "VLLM_API_KEY"}, "api_key and api_key_env exclude each other"),
    ({"api_key_env": "not a name"}, "api_key_env"),
    ({"api_key_env": ""}, "api_key_env"),
    ({"api_key": ""}, "api_key"),  # an empty key would mean open routes; say so instead
])
def test_api_key_fields_are_checked(args, field):
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate(args)
    assert field in str(err.value)


def test_api_key_source_follows_the_fields(monkeypatch):
    assert AppConfig().api_key_source is None  # no key: the routes are open, as before
    assert AppConfig(api_key="s3cret").api_key_source.resolve({}) == "s3cret"
    source = AppConfig(api_key_env="ADASPEC_TEST_API_KEY").api_key_source
    assert source == ApiKeySource(env="ADASPEC_TEST_API_KEY")
    assert source.resolve({"ADASPEC_TEST_API_KEY": "from-a-secret"}) == "from-a-secret"
    for environ in [{}, {"ADASPEC_TEST_API_KEY": ""}]:
        with pytest.raises(ValueError, match=r"^api_key_env: the environment variable ADASPEC_TEST_API_KEY"):
            source.resolve(environ)
    assert "s3cret" not in repr(AppConfig(api_key="s3cret").api_key_source)  # kept out of logs


def test_build_app_hands_the_key_source_to_the_ingress_unread(monkeypatch):
    """The deploying machine need not have the variable (on KubeRay only the pods do): build_app
    passes where the key comes from, the ingress reads it where it runs."""
    monkeypatch.delenv("ADASPEC_TEST_API_KEY", raising=False)
    args = AppConfig.from_yaml(str(REPO / "configs" / "app.yaml")).model_dump()
    args["api_key_env"] = "ADASPEC_TEST_API_KEY"
    ingress = build_app(args)._bound_deployment
    assert ingress.init_kwargs["api_key"] == ApiKeySource(env="ADASPEC_TEST_API_KEY")
    assert build_app(AppConfig.from_yaml(str(REPO / "configs" / "app.yaml")).model_dump()
                     )._bound_deployment.init_kwargs["api_key"] is None


@pytest.mark.parametrize("config", ["app-gpu-tp2.yaml", "app-gpu-eagle3.yaml"])
def test_gpu_configs_require_an_api_key_from_the_environment(config):
    """The GPU configs serve on 0.0.0.0: their OpenAI routes take the key from vLLM's variable."""
    cfg = AppConfig.from_yaml(str(REPO / "configs" / config))
    assert cfg.api_key is None and cfg.api_key_env == "VLLM_API_KEY"
