"""Ray Serve LLM's args read by adaspec (`serve_app:build_openai_app`): what maps to adaspec's
config, what passes to the replica's LLMConfig as the user wrote it, and what is refused with
the field's Ray name. No engine is started here (tests/test_app_ray_serve_llm.py runs one)."""

from __future__ import annotations

import copy

import pytest
import yaml
from ray.serve.llm import build_openai_app as ray_build_openai_app

from cli.serve_config import ConfigError, check_serve_config
from serve_app.builder import build_openai_app, llm_config
from serve_app.config import AppConfig
from serve_app.ray_serving_args import RayArgsError, policy_from_schedule, read_serving_args
from serve_app.vllm_cudagraphs import START_POLICY_ENV
from testkit.serve_process import REPO

CONFIG = REPO / "configs" / "ray-serve-llm.yaml"


@pytest.fixture(autouse=True, scope="module")
def no_local_ray_left():
    """Building a deployment starts a local Ray instance in this process; stop it so later
    tests can join the server's cluster."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def example_args() -> dict:
    return yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]


def with_llm(**fields) -> dict:
    """The example's args with fields of its one LLMConfig replaced."""
    args = example_args()
    args["llm_configs"][0].update(fields)
    return args


def with_engine_kwargs(**kwargs) -> dict:
    args = example_args()
    args["llm_configs"][0]["engine_kwargs"].update(kwargs)
    return args


def test_the_example_builds_under_ray_serve_llm_and_under_adaspec():
    ray_args = example_args()
    ray_args["llm_configs"][0]["model_loading_config"]["model_source"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    ray_app = ray_build_openai_app(ray_args)  # Ray's own builder takes it as it is
    assert ray_app._bound_deployment.name == "OpenAiIngress"

    app = build_openai_app(example_args())
    ingress = app._bound_deployment
    assert ingress.name == "AdaspecIngress"
    (replicas,) = ingress.init_kwargs["llm_deployments"].values()
    assert replicas._bound_deployment.func_or_class.__name__ == "SpecReplica"
    # The user's ingress_deployment_config is applied over adaspec's ingress options.
    assert ingress._deployment_config.max_ongoing_requests == 1_000_000_000
    assert ingress.ray_actor_options["num_cpus"] == 0
    assert ingress.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    assert check_serve_config(CONFIG) is None


def test_ray_fields_become_adaspecs():
    (model,) = read_serving_args(example_args()).models
    cfg = model.app
    assert (cfg.model, cfg.model_id, cfg.accelerator) == ("smollm2-135m-instruct", "smollm2-135m-instruct", "cpu")
    assert (cfg.tensor_parallel_size, cfg.max_model_len, cfg.dtype, cfg.kv_cache_gib) == (1, 2048, "float32", 1.0)
    assert (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas) == (1, 1)
    assert cfg.engine_kwargs == {}
    # No speculative_config: adaspec's default drafter, with the controller on.
    assert (cfg.speculation.method, cfg.speculation.max_k, cfg.speculation.policy) == ("ngram", 4, "chain4")
    assert cfg.controller.enabled and not cfg.admin.enabled


def test_speculative_config_becomes_the_drafter_max_k_and_start_policy():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cfg = read_serving_args(with_engine_kwargs(speculative_config=spec)).models[0].app
    assert (cfg.speculation.method, cfg.speculation.max_k, cfg.speculation.policy) == ("ngram", 3, "chain3")
    assert (cfg.speculation.prompt_lookup_min, cfg.speculation.prompt_lookup_max) == (1, 3)

    draft = {"method": "draft_model", "model": "smollm2-135m-instruct-draft", "num_speculative_tokens": 4}
    cfg = read_serving_args(with_engine_kwargs(speculative_config=draft)).models[0].app
    assert (cfg.speculation.method, cfg.speculation.draft_model) == ("draft_model", "smollm2-135m-instruct-draft")

    table = {**spec, "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 1], [9, 1024, 0]]}
    cfg = read_serving_args(with_engine_kwargs(speculative_config=table, max_num_seqs=32)).models[0].app
    assert cfg.speculation.policy == "1-2:chain3,3-8:chain1,9+:off"

    args = with_engine_kwargs(speculative_config=table)
    args["adaspec"] = {"policy": "1+:chain2"}
    assert read_serving_args(args).models[0].app.speculation.policy == "1+:chain2"


def test_vllms_schedule_reads_as_vllm_reads_it():
    # A gap carries the previous k, and so does the rest past the last range; k is capped at
    # num_speculative_tokens.
    assert policy_from_schedule([[1, 16, 3], [32, 128, 2]], 64, 4) == "1-31:chain3,32+:chain2"
    assert policy_from_schedule([[1, 2, 3]], 8, 4) == "1+:chain3"
    assert policy_from_schedule([[1, 4, 8]], 8, 4) == "1+:chain4"
    with pytest.raises(ValueError, match="must start at 1"):
        policy_from_schedule([[2, 4, 3]], 8, 4)


def test_fields_adaspec_does_not_read_pass_to_the_replica_as_written():
    args = with_llm(accelerator_type="A10G", experimental_configs={"stream_batching_interval_ms": 25},
                    log_engine_metrics=False)
    llm = args["llm_configs"][0]
    del llm["accelerator_config"], llm["placement_group_config"]  # a GPU replica, as in Ray's example
    llm["deployment_config"].update(graceful_shutdown_timeout_s=7, ray_actor_options={"num_cpus": 0, "memory": 2**30})
    llm["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] = "1"
    llm["engine_kwargs"]["enable_prefix_caching"] = False
    (model,) = read_serving_args(args).models
    config = llm_config(model.app, model.user)
    assert config.accelerator_type == "A10G"
    assert config.experimental_configs == {"stream_batching_interval_ms": 25}
    assert config.log_engine_metrics is False
    assert config.deployment_config["graceful_shutdown_timeout_s"] == 7
    assert config.deployment_config["ray_actor_options"] == {"num_cpus": 0, "memory": 2**30}
    assert config.deployment_config["autoscaling_config"]["max_replicas"] == 1
    assert (model.app.accelerator, model.app.accelerator_type) == ("gpu", "A10G")
    assert config.placement_group_config["bundles"] == [{"GPU": 1, "CPU": 1}]
    env = config.runtime_env["env_vars"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_USE_V1"] == "1" and env[START_POLICY_ENV] == "1+:chain4"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # prompt lookup drafts the step's k on V1 only
    assert config.engine_kwargs["enable_prefix_caching"] is False
    assert config.engine_kwargs["scheduler_cls"] == "serve_app.vllm_scheduler.AdaspecScheduler"


def test_several_models_get_a_replica_deployment_each_behind_one_ingress():
    args = example_args()
    second = copy.deepcopy(args["llm_configs"][0])
    second["model_loading_config"]["model_id"] = "smollm2-135m-instruct-b"
    args["llm_configs"].append(second)
    ingress = build_openai_app(args)._bound_deployment
    assert sorted(ingress.init_kwargs["llm_deployments"]) == ["smollm2-135m-instruct", "smollm2-135m-instruct-b"]
    assert sorted(ingress.init_kwargs["model_cards"]) == ["smollm2-135m-instruct", "smollm2-135m-instruct-b"]

    args["llm_configs"][1]["model_loading_config"]["model_id"] = "smollm2-135m-instruct"
    with pytest.raises(ValueError, match=r"Duplicate models found"):  # Ray's own check
        read_serving_args(args)


def test_the_adaspec_block_sets_what_ray_has_no_place_for():
    args = example_args()
    args["adaspec"] = {"controller": {"period_s": 2.0}, "admin": {"enabled": True}, "routing": "power_of_two",
                       "api_key_env": "VLLM_API_KEY"}
    cfg = read_serving_args(args).models[0].app
    # Tuning the controller does not turn it off.
    assert cfg.controller.enabled and cfg.controller.period_s == 2.0
    assert cfg.admin.enabled and cfg.router == "power_of_two" and cfg.api_key_source.env == "VLLM_API_KEY"
    args["adaspec"] = {"controller": {"enabled": False}}
    assert not read_serving_args(args).models[0].app.controller.enabled


@pytest.mark.parametrize("args,field", [
    (with_llm(lora_config={"dynamic_lora_loading_path": "s3://bucket/adapters"}), "llm_configs[0].lora_config: "),
    (with_llm(server_cls="ray.serve.llm.deployment.LLMServer"), "llm_configs[0].server_cls: "),
    (with_llm(llm_engine="SGLang"), None),  # Ray's own model refuses an engine it does not know
    (with_engine_kwargs(speculative_config={"method": "medusa", "num_speculative_tokens": 2}),
     "llm_configs[0].engine_kwargs.speculative_config.method: "),
    (with_engine_kwargs(speculative_config={"method": "ngram"}),
     "llm_configs[0].engine_kwargs.speculative_config.num_speculative_tokens: required"),
    (with_engine_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "quantization": "fp8"}),
     "llm_configs[0].engine_kwargs.speculative_config.quantization: not read by adaspec"),
    (with_engine_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "num_speculative_tokens_per_batch_size": [[3, 1, 2]]}),
     "llm_configs[0].engine_kwargs.speculative_config.num_speculative_tokens_per_batch_size: "),
    (with_engine_kwargs(max_model_len=8), "llm_configs[0].engine_kwargs.max_model_len: "),
    (with_engine_kwargs(scheduler_cls="my.Scheduler"), "llm_configs[0].engine_kwargs.scheduler_cls: "),
    (with_engine_kwargs(disable_log_stats=True), None),  # Ray's model: its engine metrics need the stats
    (with_llm(log_engine_metrics=False, engine_kwargs={"disable_log_stats": True}),
     "llm_configs[0].engine_kwargs.disable_log_stats: "),
    (with_engine_kwargs(not_an_arg=1), "llm_configs[0].engine_kwargs.not_an_arg: not a vLLM engine argument"),
    (with_llm(deployment_config={"request_router_config": {
        "request_router_class": "serve_app.router:SpecAwareRouter"}}),
     "llm_configs[0].deployment_config.request_router_config: "),
    (with_llm(deployment_config={"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}), None),  # Ray's
    (with_llm(deployment_config={"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}),
     "llm_configs[0].deployment_config.num_replicas: a fixed replica count and autoscaling exclude each other"),
    ({**example_args(), "ingress_cls_config": {"ingress_extra_kwargs": {"a": 1}}}, "ingress_cls_config: "),
    ({**example_args(), "unknown": 1}, None),  # Ray's model: extra fields forbidden
])
def test_what_adaspec_cannot_honour_fails_naming_the_ray_field(args, field):
    with pytest.raises(ValueError) as err:
        read_serving_args(args)
    if field is not None:
        assert str(err.value).startswith(field), str(err.value)


def test_an_owned_environment_variable_with_another_value_is_refused():
    args = with_llm(runtime_env={"env_vars": {START_POLICY_ENV: "1+:off"}})
    (model,) = read_serving_args(args).models
    with pytest.raises(RayArgsError, match=rf"runtime_env.env_vars.{START_POLICY_ENV}: the start policy"):
        llm_config(model.app, model.user)


def test_a_bad_ray_config_file_fails_adaspec_serve_naming_the_field(tmp_path):
    doc = yaml.safe_load(CONFIG.read_text())
    doc["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]["tensor_parallel_size"] = 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"args\.llm_configs\[0\]\.engine_kwargs\.tensor_parallel_size: 2 does not divide"):
        check_serve_config(bad)


def test_context_length_defaults_to_2048_on_cpu_and_to_the_models_own_on_gpu():
    assert AppConfig(accelerator="cpu").context_len == 2048
    assert AppConfig(accelerator="gpu").context_len is None
    assert AppConfig(accelerator="gpu", engine="native").context_len == 2048
    assert AppConfig(accelerator="gpu", max_model_len=8192).context_len == 8192
    assert "max_model_len" not in llm_config(AppConfig(accelerator="gpu")).engine_kwargs
