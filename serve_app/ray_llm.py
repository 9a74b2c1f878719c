"""Ray Serve LLM as adaspec uses it: the one module that imports `ray.llm._internal` (and
Ray Serve's own internals).

The public API (`ray.serve.llm`) is used wherever it has what adaspec needs; each internal
import below says why it does not. Internal modules move between Ray releases, so Ray is
pinned (pyproject.toml) and tests/test_ray_llm.py fails with a clear message when the
installed Ray's minor version is not the pinned one.
"""

from __future__ import annotations

# Public API.
from ray.serve.llm import LLMConfig, LLMServingArgs, build_llm_deployment
from ray.serve.llm.deployment import LLMServer
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

# The engine interface LLMServer drives (`engine_cls`); the native engine implements it.
# ray.serve.llm exports LLMServer but not the engine protocol it calls.
from ray.llm._internal.serve.core.engine.protocol import LLMEngine
# Ray Serve LLM's vLLM engine, subclassed to reach adaspec's scheduler; not exported.
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
# The OpenAI request and response models. ray.serve.llm.openai_api_models exports subclasses
# of these, but the ingress parses requests into these classes, so isinstance checks on a
# request need them. ErrorInfo (the body of ErrorResponse), OpenAIHTTPException (what the
# ingress turns into an OpenAI error response) and to_model_metadata (the card /v1/models
# lists) are not exported at all.
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    OpenAIHTTPException,
    to_model_metadata,
)
# The route table of OpenAiIngress, so adaspec's ingress keeps the OpenAI routes as they are,
# and the FastAPI app it builds (its middleware: errors, request ids, metrics), so adaspec can
# add handlers to it; make_fastapi_ingress builds that app itself unless given one.
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, init as new_ingress_app
# How ray.serve.llm:build_openai_app merges the user's ingress_deployment_config into the
# ingress's defaults (a user's num_replicas drops the default autoscaling); not exported.
from ray.llm._internal.serve.core.ingress.builder import maybe_apply_llm_deployment_config_defaults
# Serve's power-of-two-choices router, the fallback of serve_app/router.py's router (subclassed,
# not rewritten); ray.serve.request_router exports the base class and its mixins, not it.
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
# The HTTP host the Serve instance listens on (the ingress refuses open admin routes on a
# public one); Serve's public API does not say.
from ray.serve.context import _get_global_client as serve_client
# One actor call to every replica of a deployment (the admin routes); Serve has no public
# broadcast, and a DeploymentHandle call reaches one replica.
from ray.llm._internal.serve.utils.broadcast import broadcast
# How Ray Serve LLM reads a LoRA model id (`base:adapter`): the ingress names the base model
# in its 404 for an adapter adaspec does not serve; not exported.
from ray.llm._internal.common.utils.lora_utils import get_base_model_id

# The Ray release these imports were checked against (pyproject.toml pins ray[serve]==2.60.*).
PINNED_RAY_MINOR = "2.60"

__all__ = [
    "get_base_model_id",
    "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionStreamResponse", "CompletionRequest",
    "CompletionResponse", "CompletionStreamResponse", "DEFAULT_ENDPOINTS", "ErrorInfo", "ErrorResponse",
    "LLMConfig", "LLMEngine", "LLMServingArgs", "LLMServer", "OpenAIHTTPException", "OpenAiIngress", "PINNED_RAY_MINOR", "PowerOfTwoChoicesRequestRouter",
    "VLLMEngine", "broadcast", "serve_client", "build_llm_deployment", "make_fastapi_ingress", "maybe_apply_llm_deployment_config_defaults", "new_ingress_app", "to_model_metadata",
]
