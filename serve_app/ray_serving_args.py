"""Ray Serve LLM's application args, read by adaspec: `import_path: serve_app:build_openai_app`.

A config written for `ray.serve.llm:build_openai_app` (its `LLMServingArgs`: `llm_configs`,
`ingress_deployment_config`) runs under adaspec by changing the import path only. It is
validated by Ray's own models first, so a Ray user gets Ray's errors for Ray's fields. Each
`LLMConfig` then becomes one adaspec model (an `AppConfig`, the flat schema of
`serve_app:build_app`):
- `engine_kwargs.speculative_config` becomes the drafter, its `num_speculative_tokens` the
  engine's max k and the start policy (`chainK`); vLLM's `num_speculative_tokens_per_batch_size`
  schedule is read with vLLM's own parser and becomes the start policy table. Without it the
  model speculates with adaspec's default (prompt lookup, k up to 4), which the controller
  turns off where it does not pay.
- `max_model_len`, `max_num_seqs`, `tensor_parallel_size`, `dtype`, `kv_cache_memory_bytes`
  become adaspec's fields; the rest of `engine_kwargs` passes to vLLM as it is.
- `accelerator_type` and `accelerator_config.kind` become adaspec's `accelerator_type` and
  `accelerator`; `model_loading_config.tokenizer_source` vLLM's `tokenizer`.
- `deployment_config`: the replica count, autoscaling and queue bounds become adaspec's fields;
  the rest (and `runtime_env`, `placement_group_config`, `experimental_configs`,
  `log_engine_metrics`, `callback_config`) pass to the replica's LLMConfig (`merge_user_fields`).
A field adaspec cannot honour is refused at start with the field's Ray name and the reason.
An optional `adaspec:` block beside `llm_configs` holds what Ray's schema has no place for:
the controller (on by default here), the admin routes, the router, the start policy, the API key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from controller.config import ControllerConfig
from serve_app.config import ENV_NAME, AdminConfig, AppConfig
from serve_app.ray_llm import LLMConfig, LLMServingArgs
from serve_app.vllm_cudagraphs import START_POLICY_ENV


class AdaspecBlock(BaseModel):
    """The `adaspec:` block beside `llm_configs`: what Ray Serve LLM's schema has no place for."""

    model_config = ConfigDict(extra="forbid")

    controller: ControllerConfig = Field(
        default_factory=lambda: ControllerConfig(enabled=True),
        description="the adaptive controller (on unless `enabled: false`); one per Ray cluster, shared by every "
        "model, its state kept per model")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="the operator routes under /admin")
    routing: Literal["spec_aware", "power_of_two"] | None = Field(
        default=None, description="request router across a model's replicas; default spec_aware when more than "
        "one replica can run")
    policy: str | None = Field(
        default=None, description="start policy of every model (`adaspec policy set` syntax), instead of the one "
        "speculative_config implies")
    cpu_threads: int | None = Field(default=None, ge=1, description="torch threads of each CPU engine")
    api_key: str | None = Field(default=None, min_length=1, description="API key of the OpenAI routes")
    api_key_env: str | None = Field(
        default=None, pattern=ENV_NAME, description="environment variable holding the API key (e.g. VLLM_API_KEY)")

    @field_validator("controller", mode="before")
    @classmethod
    def _controller_on(cls, value: Any) -> Any:
        # A user who switches to adaspec wants the live controller: a block that tunes it
        # (`period_s: 2`) must not turn it off by leaving `enabled` out.
        return {"enabled": True, **value} if isinstance(value, dict) else value


# engine_kwargs keys that become AppConfig fields (vLLM's name -> adaspec's).
ENGINE_FIELDS = {"max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
                 "tensor_parallel_size": "tensor_parallel_size", "dtype": "dtype"}
# speculative_config keys that become SpeculationConfig fields (vLLM's name -> adaspec's).
SPECULATION_FIELDS = {"method": "method", "num_speculative_tokens": "max_k", "prompt_lookup_min": "prompt_lookup_min",
                      "prompt_lookup_max": "prompt_lookup_max", "draft_tensor_parallel_size": "draft_tensor_parallel_size"}
# deployment_config keys that become AppConfig fields; the rest pass through.
DEPLOYMENT_FIELDS = ("num_replicas", "max_ongoing_requests", "max_queued_requests")
AUTOSCALING_FIELDS = ("min_replicas", "max_replicas", "target_ongoing_requests")

# Where each AppConfig field came from in Ray's schema, for errors that name the user's field.
RAY_NAMES = {
    **{(adaspec,): f"engine_kwargs.{ray}" for ray, adaspec in ENGINE_FIELDS.items()},
    ("kv_cache_gib",): "engine_kwargs.kv_cache_memory_bytes",
    ("engine_kwargs",): "engine_kwargs",
    **{("speculation", adaspec): f"engine_kwargs.speculative_config.{ray}" for ray, adaspec in SPECULATION_FIELDS.items()},
    ("speculation", "draft_model"): "engine_kwargs.speculative_config.model",
    ("speculation", "proposer_class"): "engine_kwargs.speculative_config.model",
    ("speculation", "policy"): "engine_kwargs.speculative_config.num_speculative_tokens_per_batch_size",
    ("speculation",): "engine_kwargs.speculative_config",
    **{(f,): f"deployment_config.{f}" for f in DEPLOYMENT_FIELDS},
    **{("autoscaling", f): f"deployment_config.autoscaling_config.{f}" for f in AUTOSCALING_FIELDS},
    ("autoscaling",): "deployment_config.autoscaling_config",
}

# vLLM engine arguments adaspec sets itself: refused in engine_kwargs, with the reason.
OWNED_ENGINE_KWARGS = {
    "model": "the model comes from model_loading_config.model_source",
    "scheduler_cls": "adaspec's scheduler applies the live policy; a scheduler of your own would drop it",
    "disable_log_stats": "adaspec's telemetry reads vLLM's speculative-decoding stats, which this turns off",
}
# LLMConfig fields adaspec does not honour, with the reason.
REFUSED_FIELDS = {
    "lora_config": "adaspec's replicas do not load LoRA adapters yet; serve the adapters with "
                   "ray.serve.llm:build_openai_app, or remove lora_config",
    "server_cls": "adaspec's replica (serve_app.replica.SpecReplica, an LLMServer) is the server class; "
                  "a server class of your own would leave the engine without the live policy",
}


# Environment variables adaspec sets on the replica: a different value is refused, with the reason.
OWNED_ENV_VARS = {
    START_POLICY_ENV: "the start policy; set it with speculative_config or adaspec.policy",
    "VLLM_USE_V2_MODEL_RUNNER": "adaspec picks the model runner whose drafter drafts the step's k for this "
                                "drafting method (docs/configuration.md, Drafting methods)",
}


class RayArgsError(ValueError):
    """Ray Serve LLM args adaspec cannot serve; the message names the field as Ray spells it."""


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model of the app: adaspec's config for it, and the user's own LLMConfig, whose
    fields adaspec does not read pass to the replica's LLMConfig (merge_user_fields)."""

    app: AppConfig
    user: LLMConfig | None = None


@dataclasses.dataclass(frozen=True)
class OpenAiApp:
    """What `serve_app:build_openai_app` builds: the models (each carries the adaspec block's
    app-wide settings) and the ingress's deployment options."""

    models: list[ServedModel]
    ingress_deployment_config: dict[str, Any]


def policy_from_schedule(schedule: Any, max_num_seqs: int, max_k: int) -> str:
    """vLLM's `num_speculative_tokens_per_batch_size` ([[first, last, k], ...]) as an adaspec
    policy table, expanded by vLLM's own parser (gaps carry the previous k, k is capped at
    num_speculative_tokens) and written back as ranges, the last one open-ended."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    dense = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=max_num_seqs,
                                             vllm_num_speculative_tokens=max_k)[1:]
    rules, start = [], 1
    for batch in range(1, len(dense) + 1):
        if batch == len(dense) or dense[batch] != dense[batch - 1]:
            k = dense[batch - 1]
            upper = "+" if batch == len(dense) else f"-{batch}"
            rules.append(f"{start}{upper}:{f'chain{k}' if k else 'off'}")
            start = batch + 1
    return ",".join(rules)


def _speculation(spec: dict[str, Any], max_num_seqs: int, start_policy: str | None) -> dict[str, Any]:
    """adaspec's `speculation` block from vLLM's speculative_config."""
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key in SPECULATION_FIELDS:
            out[SPECULATION_FIELDS[key]] = value
        elif key == "model":
            out["proposer_class" if spec.get("method") == "custom_class" else "draft_model"] = value
        elif key != "num_speculative_tokens_per_batch_size":
            raise RayArgsError(f"engine_kwargs.speculative_config.{key}: not read by adaspec, which sets up vLLM's "
                               f"speculative_config itself; it reads {sorted([*SPECULATION_FIELDS, 'model', 'num_speculative_tokens_per_batch_size'])}")
    if "max_k" not in out:
        raise RayArgsError("engine_kwargs.speculative_config.num_speculative_tokens: required (the most draft tokens "
                           "a step may verify; adaspec's policies use 0 up to it)")
    if start_policy is not None:
        out["policy"] = start_policy
    elif spec.get("num_speculative_tokens_per_batch_size") is not None:
        try:
            out["policy"] = policy_from_schedule(spec["num_speculative_tokens_per_batch_size"], max_num_seqs, out["max_k"])
        except (ValueError, TypeError) as e:
            raise RayArgsError(f"engine_kwargs.speculative_config.num_speculative_tokens_per_batch_size: {e}") from None
    else:
        out["policy"] = f"chain{out['max_k']}"
    return out


def _deployment(deployment: dict[str, Any]) -> dict[str, Any]:
    """adaspec's replica-count and queue fields from Serve's deployment_config."""
    out = {key: deployment[key] for key in DEPLOYMENT_FIELDS if key in deployment}
    auto = deployment.get("autoscaling_config")
    if auto is not None:
        auto = _as_dict(auto)
        out["autoscaling"] = {key: auto[key] for key in AUTOSCALING_FIELDS if key in auto}
    if "request_router_config" in deployment:
        raise RayArgsError("deployment_config.request_router_config: adaspec routes requests itself (the "
                           "speculation-aware router, or Serve's power of two choices); choose with adaspec.routing")
    return out


def app_config(user: LLMConfig, block: AdaspecBlock) -> AppConfig:
    """One LLMConfig (validated by Ray) and the app's adaspec block as adaspec's AppConfig.
    RayArgsError names the Ray field that cannot be honoured."""
    for name, why in REFUSED_FIELDS.items():
        if getattr(user, name) is not None:
            raise RayArgsError(f"{name}: {why}")
    if user.llm_engine != "vLLM":
        raise RayArgsError(f"llm_engine: adaspec serves vLLM engines (and its own native engine, through "
                           f"serve_app:build_app); not {user.llm_engine}")
    kind = user.accelerator_config.kind if user.accelerator_config is not None else "gpu"
    if kind not in ("cpu", "gpu"):
        raise RayArgsError(f"accelerator_config.kind: adaspec runs engines on cpu or gpu, not {kind}")
    loading = user.model_loading_config
    if loading.model_source is not None and not isinstance(loading.model_source, str):
        raise RayArgsError("model_loading_config.model_source: a cloud mirror is not read by adaspec yet; give a "
                           "Hugging Face id or a folder")

    engine_kwargs = dict(user.engine_kwargs)
    for key, why in OWNED_ENGINE_KWARGS.items():
        if key in engine_kwargs and not (key == "disable_log_stats" and engine_kwargs[key] is False):
            raise RayArgsError(f"engine_kwargs.{key}: {why}")
    engine_kwargs.pop("disable_log_stats", None)
    if loading.tokenizer_source is not None:
        engine_kwargs.setdefault("tokenizer", loading.tokenizer_source)
    args: dict[str, Any] = {
        "model": loading.model_source or loading.model_id,
        "served_model_name": loading.model_id,
        "accelerator": kind,
        "accelerator_type": user.accelerator_type,
        "controller": block.controller,
        "admin": block.admin,
        "routing": block.routing,
        "cpu_threads": block.cpu_threads,
        "api_key": block.api_key,
        "api_key_env": block.api_key_env,
    }
    for ray_name, name in ENGINE_FIELDS.items():
        if ray_name in engine_kwargs:
            args[name] = engine_kwargs.pop(ray_name)
    if "kv_cache_memory_bytes" in engine_kwargs:
        args["kv_cache_gib"] = engine_kwargs.pop("kv_cache_memory_bytes") / 2**30
    max_num_seqs = args.get("max_num_seqs", AppConfig.model_fields["max_num_seqs"].default)
    spec = engine_kwargs.pop("speculative_config", None)
    if spec is not None:
        args["speculation"] = _speculation(dict(spec), max_num_seqs, block.policy)
    elif block.policy is not None:
        args["speculation"] = {"policy": block.policy}
    args["engine_kwargs"] = engine_kwargs
    args.update(_deployment(user.deployment_config))
    try:
        cfg = AppConfig.model_validate(args)
        cfg.check_engine_kwargs()
    except ValidationError as e:
        raise RayArgsError("; ".join(_ray_error(err) for err in e.errors())) from None
    except ValueError as e:
        raise RayArgsError(in_ray_terms(str(e))) from None
    return cfg


def _ray_error(err: dict[str, Any]) -> str:
    """A pydantic error of AppConfig, located by the Ray field the value came from."""
    loc = tuple(str(p) for p in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    for length in range(len(loc), 0, -1):
        if loc[:length] in RAY_NAMES:
            return f"{RAY_NAMES[loc[:length]]}: {message}"
    return in_ray_terms(f"{'.'.join(loc)}: {message}" if loc else message)


def in_ray_terms(message: str) -> str:
    """An adaspec error that starts with adaspec's field name (`speculation.max_k: ...`), with the
    name of the Ray field it came from instead, where there is one."""
    head, sep, rest = message.partition(": ")
    name = RAY_NAMES.get(tuple(head.split(".")))
    return f"{name}: {rest}" if sep and name else message


def read_serving_args(args: dict[str, Any]) -> OpenAiApp:
    """Ray Serve LLM's LLMServingArgs (validated by Ray's own model) plus an optional `adaspec:`
    block, as the models adaspec serves. RayArgsError names the field it cannot honour, prefixed
    with its place (`llm_configs[0].engine_kwargs...`)."""
    args = dict(args)
    block = AdaspecBlock.model_validate(args.pop("adaspec", None) or {})
    serving = LLMServingArgs.model_validate(args)
    if "ingress_cls_config" in serving.model_fields_set:
        raise RayArgsError("ingress_cls_config: adaspec's ingress (OpenAI routes, readiness and the admin routes) "
                           "is the ingress; remove ingress_cls_config")
    models = []
    for i, user in enumerate(serving.llm_configs):
        try:
            models.append(ServedModel(app=app_config(user, block), user=user))
        except RayArgsError as e:
            raise RayArgsError(f"llm_configs[{i}].{e}") from None
    return OpenAiApp(models=models, ingress_deployment_config=serving.ingress_deployment_config)


def merge_user_fields(kwargs: dict[str, Any], user: LLMConfig) -> dict[str, Any]:
    """The replica's LLMConfig arguments as adaspec built them (`kwargs`), with the user's own
    LLMConfig fields that adaspec did not read: theirs kept, adaspec's environment variables
    and deployment options added where the user set none."""
    out = dict(kwargs)
    if user.placement_group_config is not None:
        out["placement_group_config"] = user.placement_group_config
    passed = {k: v for k, v in user.deployment_config.items() if k not in DEPLOYMENT_FIELDS}
    ours = dict(out.get("deployment_config") or {})
    if "autoscaling_config" in passed and "autoscaling_config" in ours:
        passed["autoscaling_config"] = {**ours["autoscaling_config"], **_as_dict(passed["autoscaling_config"])}
    if "ray_actor_options" in passed and "ray_actor_options" in ours:
        passed["ray_actor_options"] = {**ours["ray_actor_options"], **passed["ray_actor_options"]}
    out["deployment_config"] = {**ours, **passed}
    if user.runtime_env:
        env = dict(user.runtime_env)
        ours_env = (out.get("runtime_env") or {}).get("env_vars", {})
        theirs_env = env.get("env_vars") or {}
        for name in OWNED_ENV_VARS:
            if name in theirs_env and name in ours_env and theirs_env[name] != ours_env[name]:
                raise RayArgsError(f"runtime_env.env_vars.{name}: {OWNED_ENV_VARS[name]}")
        env["env_vars"] = {**ours_env, **theirs_env}
        out["runtime_env"] = env
    out["experimental_configs"] = user.experimental_configs
    out["log_engine_metrics"] = user.log_engine_metrics
    out["callback_config"] = user.callback_config
    return out


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else value.model_dump(exclude_unset=True)
