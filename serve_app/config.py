"""The application config: the `args:` block of a Ray Serve config that imports serve_app.

Every field is validated at `serve run` time; an error names the field (pydantic's
location, e.g. `speculation.max_k`). Defaults are the embedded CPU setup, so a config that
says only `model: smollm2-135m-instruct` starts on a 2-core laptop.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adaspec.models import DEFAULT_MODEL
from adaspec.policy import PolicyError, SpecPolicy
from controller.config import ControllerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The drafting methods adaspec serves: each drafts on demand the k the live policy asks for
# (docs/configuration.md, "Drafting methods": which model runner drafts only k and which
# always drafts max_k). vLLM 0.32's other methods are refused with the reason; the names are
# pinned against vLLM's own list by tests/test_vllm_contract.py.
DraftMethod = Literal["ngram", "ngram_gpu", "draft_model", "eagle", "eagle3", "mtp", "custom_class"]
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")  # speculation.draft_model is vLLM's `model`
HEAD_METHODS = ("eagle", "eagle3")  # a head trained on the target's hidden states; no default
HEAD_EXAMPLES = {"eagle": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle3": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}

# Measured 2026-12-02 (docs/field-notes.md): with arctic_inference.suffix_decoding built
# (scripts/build-suffix-decoding.sh), vLLM 0.32's SuffixDecodingProposer.propose asserts that
# the step's k equals the k it was started with, so the first step under `off` or a shorter
# chain kills the engine; adaspec's policies change k every step.
SUFFIX_UNSUPPORTED = ("method: suffix is not supported with vLLM 0.32: suffix decoding proposes a variable number "
                      "of tokens per request and its proposer asserts one fixed k per step, while adaspec's live "
                      "policies change k (the engine died on the first `off` step); adaspec's live k needs a "
                      "drafter that drafts k tokens on demand")
_ON_DEMAND = "; adaspec's live k needs a drafter that drafts k tokens on demand"
REFUSED_METHODS = {
    "suffix": SUFFIX_UNSUPPORTED,
    "medusa": "method: medusa is not supported with vLLM 0.32: its heads predict a fixed number of positions and "
              "MedusaProposer.propose asserts that the step's k equals the configured one (v1/spec_decode/"
              "medusa.py), so the first step under a shorter chain or `off` would kill the engine" + _ON_DEMAND,
    "mlp_speculator": "method: mlp_speculator is not supported with vLLM 0.32: neither model runner builds a "
                      "proposer for it (the V1 runner has no branch, V2 lists it unsupported)" + _ON_DEMAND,
    "dflash": "method: dflash is not supported with vLLM 0.32: DFlash drafts the checkpoint's whole block of "
              "positions in one parallel pass whatever k is, so a live k saves no drafting and adaspec's step-cost "
              "model (k drafter passes) would misprice every config" + _ON_DEMAND,
    "dspark": "method: dspark is not supported with vLLM 0.32: DSpark drafts a fixed block in parallel and "
              "chooses how many drafts to verify itself (adaptive verification), which a live policy would fight; "
              "the V2 model runner also refuses it" + _ON_DEMAND,
    "extract_hidden_states": "method: extract_hidden_states is not a drafter: it records the target's hidden "
                             "states (for training a drafter) and proposes no tokens" + _ON_DEMAND,
}
# vLLM 0.32 renames each model-specific MTP method (deepseek_mtp, qwen3_next_mtp, ...) to `mtp`
# with a deprecation warning (vllm/config/speculative.py, SpeculativeConfig.__post_init__).
MTP_ALIAS_SUFFIX = "_mtp"


class SpeculationConfig(_Strict):
    """How the engine drafts, and the policy it starts with."""

    method: DraftMethod = Field(
        default="ngram", description="drafter: `ngram` (prompt lookup on the CPU), `ngram_gpu` (the same on the GPU; "
        "accelerator gpu only), `draft_model` (a small model of the same vocabulary), `eagle` / `eagle3` (an EAGLE "
        "or EAGLE-3 head in draft_model), `mtp` (the target's own multi-token-prediction layers, or a checkpoint in "
        "draft_model), `custom_class` (a vLLM proposer class of your own, proposer_class); vLLM's other methods "
        "(suffix, medusa, mlp_speculator, dflash, dspark, extract_hidden_states) are refused with the reason"
    )
    max_k: int = Field(
        default=4, ge=1, le=16,
        description="draft tokens per step the engine is started for; live policies may use 0..max_k",
    )
    draft_model: str | None = Field(
        default=None, description="the draft model (draft_model) or head (eagle, eagle3, mtp) as an embedded name, "
        "folder or HF id: vLLM's speculative_config.model; required for draft_model, eagle and eagle3, optional "
        "for mtp (default: the target's own MTP layers)"
    )
    draft_tensor_parallel_size: int | None = Field(
        default=None, ge=1,
        description="draft_model, eagle, eagle3, mtp: tensor-parallel ranks of the drafter, 1 or tensor_parallel_size "
        "(vLLM's rule); default tensor_parallel_size",
    )
    proposer_class: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$",
        description="custom_class only: import path of the proposer class (`package.module.Class`), which vLLM "
        "builds with its VllmConfig in each worker (vllm/v1/spec_decode/custom_class_proposer.py); vLLM's "
        "speculative_config.model",
    )
    prompt_lookup_min: int = Field(default=2, ge=1, description="ngram, ngram_gpu: shortest n-gram matched (tokens)")
    prompt_lookup_max: int = Field(default=4, ge=1, description="ngram, ngram_gpu: longest n-gram matched (tokens)")
    policy: str = Field(
        default="chain4",
        description="policy at start, same syntax as `adaspec policy set`: e.g. `1-2:chain4,3-8:chain2,9+:off` "
        "(batch sizes -> config); engine native also runs trees and per-request budgets (`auto`, `budgetN`)",
    )

    @field_validator("method", mode="before")
    @classmethod
    def _refuse_with_reason(cls, value: object) -> object:
        if isinstance(value, str):
            if value in REFUSED_METHODS:
                raise ValueError(REFUSED_METHODS[value])
            if value.endswith(MTP_ALIAS_SUFFIX):
                raise ValueError(f"method: vLLM 0.32 renames {value} to mtp (with a deprecation warning); "
                                 f"write `method: mtp`, the head (if not the target's own layers) in draft_model")
        return value

    @field_validator("policy")
    @classmethod
    def _parse_policy(cls, value: str) -> str:
        try:
            SpecPolicy.parse(value)
        except (PolicyError, ValueError) as e:
            raise ValueError(str(e)) from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SpeculationConfig:
        method = self.method
        if method == "draft_model" and self.draft_model is None:
            raise ValueError("speculation.draft_model: method draft_model needs a draft model")
        if method in HEAD_METHODS and self.draft_model is None:
            raise ValueError(f"speculation.draft_model: method {method} needs the head's weights (e.g. "
                             f"{HEAD_EXAMPLES[method]}); vLLM has no default head")
        if method not in MODEL_METHODS and self.draft_model is not None:
            raise ValueError(f"speculation.draft_model: method {method} drafts without a model; remove it "
                             f"(read by {', '.join(MODEL_METHODS)})")
        if method not in MODEL_METHODS and self.draft_tensor_parallel_size is not None:
            raise ValueError(f"speculation.draft_tensor_parallel_size: method {method} has no draft model to split")
        if (method == "custom_class") != (self.proposer_class is not None):
            raise ValueError("speculation.proposer_class: the proposer's import path is set exactly when method is "
                             "custom_class")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        depth = self.initial_policy().max_depth
        if depth > self.max_k:
            raise ValueError(f"policy drafts up to {depth} tokens but max_k is {self.max_k}")
        return self

    def initial_policy(self) -> SpecPolicy:
        return SpecPolicy.parse(self.policy, version=0)


def is_loopback(host: str) -> bool:
    """Whether an HTTP host is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class AdminConfig(_Strict):
    """The operator routes under /admin (status, policy), used by `adaspec status|policy`."""

    enabled: bool = Field(default=False, description="serve /admin routes; keep off on a public port")
    token: str | None = Field(default=None, description="bearer token required on /admin routes")
    token_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of an environment variable holding the bearer token, read by the ingress when it "
        "starts (e.g. set from a Kubernetes Secret); instead of token, so the secret stays out of the config")

    @model_validator(mode="after")
    def _one_token(self) -> AdminConfig:
        if self.token is not None and self.token_env is not None:
            raise ValueError("token and token_env exclude each other: give the token, or the variable holding it")
        return self

    def check_exposure(self, host: str) -> None:
        """Refuse admin routes without a token on a server reachable from other machines
        (`host`: the HTTP host Serve listens on). ValueError naming admin.token."""
        if self.enabled and self.token is None and self.token_env is None and not is_loopback(host):
            raise ValueError(f"admin.token: the admin routes are enabled without a token on host {host!r}, which "
                             f"other machines can reach; set admin.token (or admin.token_env, the variable holding "
                             f"it), or admin.enabled: false, or serve on 127.0.0.1")

    def resolve_token(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The bearer token in force: `token`, or the value of the variable `token_env` names.

        Read where the ingress runs, not where the config is checked: on a cluster the
        variable is set in the pods, not on the machine that deploys. An unset or empty
        variable is an error rather than "no token", which would open the routes."""
        if self.token_env is None:
            return self.token
        return secret_from_env("admin.token_env", self.token_env, "the admin bearer token", environ)


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # a POSIX environment variable's name


def secret_from_env(field: str, variable: str, what: str, environ: Mapping[str, str]) -> str:
    """The value of `variable`, which the config's `field` names. An unset or empty variable is an
    error, not "no secret": that would serve routes open while the config says they are closed."""
    value = environ.get(variable)
    if not value:
        raise ValueError(f"{field}: the environment variable {variable} is unset or empty where the ingress runs; "
                         f"set it to {what} (on Kubernetes, from a Secret) or remove {field}")
    return value


@dataclasses.dataclass(frozen=True)
class ApiKeySource:
    """Where the OpenAI routes' API key comes from: `api_key` itself or the variable
    `api_key_env` names. What build_app hands the ingress, which resolves it where it runs:
    on a cluster the variable is set in the pods, not on the machine that deploys."""

    key: str | None = dataclasses.field(default=None, repr=False)  # kept out of logs and tracebacks
    env: str | None = None

    def resolve(self, environ: Mapping[str, str] = os.environ) -> str:
        """The key in force. An unset or empty variable is an error, not "no key": that would
        serve the routes open while the config says they are closed."""
        if self.env is None:
            assert self.key, "AppConfig validates a literal key as non-empty"
            return self.key
        return secret_from_env("api_key_env", self.env, "the API key of the OpenAI routes", environ)


# The default context window of a CPU engine: KV cache sized for a laptop (1 GiB on cpu).
CPU_CONTEXT_LEN = 2048


class AutoscalingSettings(_Strict):
    """Ray Serve's own replica autoscaling (its `autoscaling_config` on the replica deployment)."""

    min_replicas: int = Field(default=1, ge=1, description="fewest replicas (at least 1: an engine takes minutes to start)")
    max_replicas: int = Field(default=2, ge=1, description="most replicas")
    target_ongoing_requests: float | None = Field(
        default=None, gt=0,
        description="requests per replica Serve scales to keep (running and queued); default max_num_seqs")

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class AppConfig(_Strict):
    """One adaspec application: an OpenAI ingress and N speculative replicas of one model."""

    model: str = Field(
        default=DEFAULT_MODEL,
        description="embedded model name, local folder, or Hugging Face id (`owner/name`)",
    )
    served_model_name: str | None = Field(
        default=None, description="the `model` clients send; defaults to `model`"
    )
    engine: Literal["vllm", "native"] = Field(
        default="vllm",
        description="engine in each replica: `vllm` (chains), or `native`, adaspec's tree engine (float32 or "
        "bfloat16; a KV cache of max_num_seqs rows of max_model_len tokens; no tensor parallelism, "
        "kv_cache_gib or engine_kwargs)",
    )
    accelerator: Literal["cpu", "gpu"] = Field(default="cpu", description="where each replica's engine runs")
    accelerator_type: str | None = Field(
        default=None, description="gpu only: the GPU type each replica is placed on (Ray's accelerator type, e.g. "
        "`A10G`, `L4`, `H100`: Ray Serve LLM's accelerator_type); default any GPU")
    tensor_parallel_size: int = Field(
        default=1, ge=1,
        description="tensor-parallel ranks per replica (vllm only): one placement-group bundle each (a GPU, "
        "or on cpu a core), packed on one node; must divide the model's attention heads",
    )
    num_replicas: int = Field(default=1, ge=1, description="engine replicas (one engine each)")
    autoscaling: AutoscalingSettings | None = Field(
        default=None,
        description="scale the replicas with Ray Serve's autoscaler instead (then leave num_replicas at 1)")
    routing: Literal["spec_aware", "power_of_two"] | None = Field(
        default=None,
        description="request router across replicas: `spec_aware` (least predicted completion time from each "
        "replica's batch, queue, step time and accepted tokens; docs/routing.md) or Ray Serve's "
        "`power_of_two`; default spec_aware when more than one replica can run")
    max_ongoing_requests: int | None = Field(
        default=None, ge=1,
        description="requests a replica holds at once, running or waiting in its engine (Serve's "
        "max_ongoing_requests); default 2 x max_num_seqs: a full batch and the next one")
    max_queued_requests: int | None = Field(
        default=None, ge=-1,
        description="requests that wait in the ingress for a replica with room (Serve's max_queued_requests); "
        "beyond it a request gets HTTP 429 with Retry-After at once; -1 = no bound; default 2 x max_num_seqs")
    max_model_len: int | None = Field(
        default=None, ge=16, description="context window (tokens); default 2048 on cpu and for engine native, on "
        "gpu the model's own (vLLM's default)")
    max_num_seqs: int = Field(default=64, ge=1, description="largest running batch (requests)")
    kv_cache_gib: float | None = Field(
        default=None, gt=0,
        description="KV cache per replica (GiB); default 1 on cpu, vLLM's memory fraction on gpu",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="weights and activations; auto: vllm float32 on cpu, the model's own on gpu; native bfloat16 "
        "on gpu, on cpu the faster of float32 and bfloat16, measured once per machine and model",
    )
    cpu_threads: int | None = Field(
        default=None, ge=1,
        description="torch threads of a CPU engine; default all cores (vllm: vLLM's own binding, all cores but "
        "one); given, a vllm engine runs that many threads unbound, so several engines can share a machine",
    )
    tree_budget: int | None = Field(
        default=None, ge=1,
        description="native only: draft nodes per sequence kept best-first from every tree config",
    )
    compile_decode: bool = Field(
        default=False,
        description="native only: compile the one-token decode pass and batch-1 verify passes with "
        "torch.compile (inductor, weights frozen, its C++ wrapper) when a replica starts: one to three minutes "
        "on 2 CPU cores, then batch-1 decode steps 1.08-1.37x faster in this project's measurements "
        "(docs/native-engine.md, Compiled decode); needs a C++ compiler and Python's headers on a CPU",
    )
    compile_autotune: bool = Field(
        default=False,
        description="native only, with compile_decode: inductor also times its own C++ GEMM kernels against the "
        "library's for every weight shape and keeps the faster: start-up about 2.5 minutes on 2 CPU cores instead "
        "of one; a bf16 batch-1 decode step 1.29x faster here, fp32 about the same (docs/native-engine.md, "
        "Compiled decode)",
    )
    speculation: SpeculationConfig = Field(
        default_factory=SpeculationConfig, description="how the engine drafts, and the policy it starts with"
    )
    controller: ControllerConfig = Field(
        default_factory=ControllerConfig,
        description="the adaptive controller that retunes every replica's policy",
    )
    api_key: str | None = Field(
        default=None, min_length=1,
        description="API key the OpenAI routes (/v1/*) require as `Authorization: Bearer <key>` (vLLM's "
        "--api-key); a wrong or missing key gets 401; /health and /admin are not covered. Readable by anyone "
        "who can read the Serve config (`serve config`, the Ray dashboard): prefer api_key_env")
    api_key_env: str | None = Field(
        default=None, pattern=ENV_NAME,
        description="name of an environment variable holding the API key (e.g. VLLM_API_KEY, set from a "
        "Kubernetes Secret), read by the ingress when it starts; instead of api_key, so the key stays out of "
        "the config")
    admin: AdminConfig = Field(default_factory=AdminConfig, description="the operator routes under /admin")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra vLLM engine arguments (AsyncEngineArgs fields, checked against vLLM's own; "
        "those adaspec sets itself are refused); vllm only",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AppConfig:
        if self.engine == "native":
            self._check_native()
        elif self.tree_budget is not None:
            raise ValueError("tree_budget: token trees need engine: native")
        elif self.compile_decode:
            raise ValueError("compile_decode: engine native only; vLLM compiles its model itself "
                             "(engine_kwargs.enforce_eager turns that off)")
        elif any(rule.config.per_request for rule in self.speculation.initial_policy().rules):
            raise ValueError("speculation.policy: per-request budgets (auto, budgetN) need engine: native")
        self._check_drafter()
        if self.accelerator_type is not None and self.accelerator != "gpu":
            raise ValueError("accelerator_type: a GPU type; set accelerator: gpu, or remove it")
        if self.compile_autotune and not self.compile_decode:
            raise ValueError("compile_autotune: tunes what compile_decode compiles; set compile_decode: true too")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("api_key and api_key_env exclude each other: give the key, or the variable holding it")
        if self.autoscaling is not None and self.num_replicas != 1:
            raise ValueError("num_replicas: a fixed replica count and autoscaling exclude each other; "
                             "set autoscaling.min_replicas/max_replicas instead")
        return self

    def _check_drafter(self) -> None:
        """The drafting method against the engine, the accelerator and the tensor parallelism."""
        spec = self.speculation
        if self.engine == "native" and spec.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculation.method: engine native drafts with ngram or draft_model, not {spec.method}")
        if spec.method == "ngram_gpu" and self.accelerator != "gpu":
            # V1's GPU n-gram proposer asserts the configured k every step (vllm/v1/spec_decode/
            # ngram_proposer_gpu.py, propose), so it runs only under Model Runner V2: CUDA and Triton.
            raise ValueError("speculation.method: ngram_gpu runs on accelerator gpu only; use ngram on cpu")
        draft_tp = spec.draft_tensor_parallel_size
        if draft_tp not in (None, 1, self.tensor_parallel_size):
            raise ValueError(f"speculation.draft_tensor_parallel_size: vLLM splits a drafter over 1 rank or over the "
                             f"target's {self.tensor_parallel_size}, not {draft_tp}")

    def _check_native(self) -> None:
        """Reject the fields the native engine has no equivalent for, naming the field."""
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: engine native runs one device per replica; use 1")
        if self.dtype == "float16":
            raise ValueError("dtype: engine native supports float32 and bfloat16")
        if self.kv_cache_gib is not None:
            raise ValueError("kv_cache_gib: engine native sizes its KV cache from max_num_seqs x max_model_len")
        if self.engine_kwargs:
            raise ValueError(f"engine_kwargs: vLLM engine arguments; engine native takes none "
                             f"(got {sorted(self.engine_kwargs)})")

    @property
    def context_len(self) -> int | None:
        """The context window in force: max_model_len, or 2048 on cpu and for the native engine
        (which sizes its KV cache from it); None on a vLLM GPU engine: vLLM takes the model's."""
        if self.max_model_len is not None:
            return self.max_model_len
        return CPU_CONTEXT_LEN if self.accelerator == "cpu" or self.engine == "native" else None

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    @property
    def api_key_source(self) -> ApiKeySource | None:
        """Where the OpenAI routes' API key comes from; None when the routes are open."""
        if self.api_key is None and self.api_key_env is None:
            return None
        return ApiKeySource(key=self.api_key, env=self.api_key_env)

    @property
    def router(self) -> Literal["spec_aware", "power_of_two"]:
        """The request router in force: `routing`, or spec_aware when more than one replica can run."""
        if self.routing is not None:
            return self.routing
        most = self.autoscaling.max_replicas if self.autoscaling else self.num_replicas
        return "spec_aware" if most > 1 else "power_of_two"

    def check_engine_kwargs(self) -> None:
        """Reject engine_kwargs that are not vLLM engine arguments or that adaspec owns."""
        if self.engine == "native":
            return  # the model validator already required them empty
        from vllm.engine.arg_utils import AsyncEngineArgs

        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        owned = {"model", "speculative_config", "scheduler_cls", "disable_log_stats",
                 "tensor_parallel_size", "max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "dtype"}
        for key in self.engine_kwargs:
            if key not in known:
                raise ValueError(f"engine_kwargs.{key}: not a vLLM engine argument")
            if key in owned:
                raise ValueError(f"engine_kwargs.{key}: set by adaspec; use its own config field")

    def check_tensor_parallel(self) -> None:
        """Reject a tensor_parallel_size that does not divide the attention heads of the
        target or the draft model (vLLM refuses it too, but only once its engine starts);
        after resolve_models."""
        from prepare.models import attention_heads, resolve_model

        spec = self.speculation
        refs = [("model", self.model, "tensor_parallel_size", self.tensor_parallel_size)]
        if spec.draft_model:
            tp_field = ("speculation.draft_tensor_parallel_size" if spec.draft_tensor_parallel_size
                        else "tensor_parallel_size")
            refs.append(("speculation.draft_model", spec.draft_model, tp_field,
                         spec.draft_tensor_parallel_size or self.tensor_parallel_size))
        for field, ref, tp_field, tp in refs:
            if tp == 1:
                continue
            heads = attention_heads(resolve_model(ref, prepare=False))
            if heads is not None and heads % tp:
                fits = [n for n in range(1, heads + 1) if heads % n == 0]
                raise ValueError(f"{tp_field}: {tp} does not divide the {heads} attention heads of "
                                 f"{field} {ref!r}; sizes that do: {fits}")

    def resolve_models(self) -> None:
        """Resolve the target (and draft) model references, preparing embedded ones; a
        ModelError names the field."""
        from adaspec.models import ModelError
        from prepare.models import resolve_model

        refs = [("model", self.model)]
        if self.speculation.draft_model:
            refs.append(("speculation.draft_model", self.speculation.draft_model))
        for field, ref in refs:
            try:
                resolve_model(ref)
            except ModelError as e:
                raise ModelError(f"{field}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str) -> AppConfig:
        """Load the `args:` of the first application in a Serve config file."""
        with open(path) as f:
            doc = yaml.safe_load(f)
        return cls.model_validate(doc["applications"][0].get("args") or {})
