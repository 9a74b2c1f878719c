"""The HTTP ingress: Ray Serve LLM's OpenAI ingress, plus the operator's /admin routes.

OpenAI routes (from ray.serve.llm): GET /v1/models, GET /v1/models/{id},
POST /v1/completions, POST /v1/chat/completions (`stream: true` for server-sent events).
With `api_key` or `api_key_env` set, every /v1 route needs `Authorization: Bearer <key>`
(401 in OpenAI's error shape otherwise; serve_app/api_key.py), as vLLM's --api-key does.

Readiness: GET /health answers 200 once every model has a replica whose engine can serve
(Serve marks a replica RUNNING only after its engine started), else 503 with Retry-After;
the ingress logs one line, "adaspec: ready to serve ...", the first time it is. /v1/models
answers from the start (it lists the configured models), so it says nothing about readiness.

Admin routes (off unless `admin.enabled`; `Authorization: Bearer <token>` when a token is
configured, as `admin.token` or in the variable `admin.token_env` names; enabled without a
token only on a loopback host, else the ingress refuses to start; bodies up to 64 KiB and
policies up to 1,000 rules), used by `adaspec status` and `adaspec policy set`:
- GET  /admin/status[?model=ID]  -> [ReplicaTelemetry], one per replica (of that model)
- POST /admin/policy  {"table": "1-2:chain4,3+:off", "replica_id": optional, "model": optional}
  -> [PolicyAck], one per replica of the model (every model's when none is given; a replica
  other than `replica_id` answers `not_this_replica`)
- GET  /admin/controller[?model=ID] -> ControllerView (404 when no controller runs)
- POST /admin/controller {"action": "pause" | "resume"} -> ControllerView
A call reaches every replica through Ray Serve LLM's `broadcast` (one actor call each). Until
the app is ready an admin call answers 503 with Retry-After at once (broadcast would wait
for replicas that are still starting, then fail).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Literal

from fastapi import FastAPI, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from vllm.v1.engine.exceptions import EngineDeadError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaspec.policy import PolicyError, SpecPolicy
from controller.config import ControllerConfig
from serve_app.admin_guard import AdminGuard
from serve_app.api_key import ApiKeyCheck
from serve_app.config import AdminConfig, ApiKeySource
from serve_app.ray_llm import (
    DEFAULT_ENDPOINTS, ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse, OpenAIHTTPException,
    OpenAiIngress, broadcast, get_base_model_id, new_ingress_app, serve_client,
)
from serve_app.request_checks import body_problem

OPENAI_ROUTES = ("models", "model_data", "completions", "chat")


logger = logging.getLogger("ray.serve")

# A replica that died (its actor, or its node), cannot be reached, or whose vLLM engine died
# (its engine-core process killed: every call fails until Serve's health check replaces it).
REPLICA_LOST = (RayActorError, ActorUnavailableError, EngineDeadError)
REPLICA_RETRIES = 2
MAX_ADMIN_BODY_BYTES = 64 * 1024  # an admin call is a policy table or an action: a few hundred bytes
MAX_POLICY_RULES = 1000  # rules in one policy (an engine runs at most a few hundred batch sizes)
RETRY_AFTER_S = 5  # what a 503 tells a client starting too early to wait (seconds)
READY_POLL_S = 2.0  # how often the ingress looks for readiness until it first sees it (seconds)


def not_ready_reason(running: dict[str, int]) -> str | None:
    """Why the app cannot serve yet, from the replicas running per model (model id ->
    replicas RUNNING); None when every model has one."""
    waiting = sorted(model for model, n in running.items() if n < 1)
    if not waiting:
        return None
    return f"no replica of {', '.join(waiting)} can serve yet: its engine is starting (or being replaced)"


def _error(code: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "code", ...}}."""
    error = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code))
    return JSONResponse(error.model_dump(), status_code=code, headers=headers)


def _unavailable(message: str) -> JSONResponse:
    return _error(status.HTTP_503_SERVICE_UNAVAILABLE, message, "ServiceUnavailableError",
                  {"Retry-After": str(RETRY_AFTER_S)})


def _stream_error(message: str) -> str:
    """A server-sent event in the shape of OpenAI's errors (the stream's last before [DONE])."""
    error = {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}
    return f"data: {json.dumps(error)}\n\n"


class ControllerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal["pause", "resume"]


class PolicyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    table: str = Field(description="policy table, e.g. `1-2:chain4,3-8:chain2,9+:off`")
    version: int | None = Field(default=None, ge=0, description="default: now, in milliseconds")
    replica_id: str | None = Field(default=None, description="one replica only (default: every replica)")
    model: str | None = Field(default=None, description="the replicas of this model only (default: every model's)")


# The request model of each OpenAI route, for request_checks.body_problem.
_ROUTE_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


async def _refuse_unservable_body(request: Request, call_next):
    """Answer 400 to a body that the routes' own parsing would turn into a 500
    (serve_app/request_checks.py), before any route reads it."""
    if request.method == "POST":
        raw = await request.body()  # Starlette replays it to the route
        if request.url.path.startswith("/admin/") and len(raw) > MAX_ADMIN_BODY_BYTES:
            return _error(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, f"admin request bodies are limited to "
                          f"{MAX_ADMIN_BODY_BYTES} bytes; this one has {len(raw)}", "RequestTooLargeError")
        problem = body_problem(raw, _ROUTE_MODELS.get(request.url.path))
        if problem is not None:
            return _error(status.HTTP_400_BAD_REQUEST, problem, "BadRequestError")
    return await call_next(request)


# FastAPI's words for a body it could not read at all: bytes that are not UTF-8, or JSON
# nested deeper than Python's parser goes.
_UNPARSABLE_BODY = "There was an error parsing the body"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 429: "RateLimitError",
                503: "ServiceUnavailableError"}


async def _openai_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own HTTP errors (an unreadable body, an unknown route, a wrong method) in
    the OpenAI error shape instead of FastAPI's `{"detail": ...}`."""
    message = str(exc.detail)
    if message == _UNPARSABLE_BODY:
        message = "the request body is not JSON this server can read: not UTF-8, or nested too deeply"
    return _error(exc.status_code, message, _ERROR_TYPES.get(exc.status_code, "InvalidRequestError"),
                  getattr(exc, "headers", None))


def ingress_app(api_key: ApiKeySource | None = None) -> FastAPI:
    """Ray Serve LLM's FastAPI app for the ingress, with FastAPI's errors in OpenAI's shape
    and the bodies its routes would fail on refused with a 400; given `api_key`, the /v1
    routes need that key (serve_app/api_key.py)."""
    app = new_ingress_app()
    app.add_exception_handler(StarletteHTTPException, _openai_http_error)
    app.middleware("http")(_refuse_unservable_body)
    if api_key is not None:
        # Added last, so it runs first: a request without the key learns nothing else
        # (not whether its body would parse) and costs no body read.
        app.add_middleware(ApiKeyCheck, source=api_key)
    return app


def _json_response(model: BaseModel) -> Response:
    # pydantic's JSON writes inf (a saturated latency, a never-reached break-even rate) as
    # null; the default JSON response would refuse it.
    return Response(content=model.model_dump_json(), media_type="application/json")


def new_policy_version() -> int:
    """Policy versions are wall-clock milliseconds, so every writer's versions interleave."""
    return time.time_ns() // 1_000_000


def check_api_key_source(source: ApiKeySource | None, environ: Mapping[str, str] = os.environ) -> None:
    """Fail the ingress's start when the API key's variable is unset (ValueError naming
    api_key_env), and warn when the routes are open though VLLM_API_KEY is set: a vLLM user's
    habit, which adaspec (like Ray Serve LLM) does not read unless the config names it."""
    if source is not None:
        source.resolve(environ)
    elif environ.get("VLLM_API_KEY"):
        logger.warning("adaspec: VLLM_API_KEY is set but the config sets neither api_key nor api_key_env, so "
                       "the OpenAI routes are open; set `api_key_env: VLLM_API_KEY` to require it")


class AdaspecIngress(OpenAiIngress):
    """OpenAI ingress with admin routes that reach every replica of the model."""

    def __init__(self, llm_deployments, model_cards, *, admin: AdminConfig,
                 controller: ControllerConfig | None = None, api_key: ApiKeySource | None = None, **kwargs):
        super().__init__(llm_deployments, model_cards, **kwargs)
        # Checked once, at start: a missing token variable, or open routes on a public host,
        # fails the deployment here with the field named, instead of every admin call later.
        host = serve_client().get_serve_details()["http_options"]["host"] if admin.enabled else ""
        self._admin = AdminGuard(admin, host)
        # The same for the API key's variable: ApiKeyCheck reads it too, but only when the app
        # first runs (Serve's ASGI lifespan start-up, whose failure Serve reports as "ASGI
        # lifespan startup failed", the reason left in the replica's log).
        check_api_key_source(api_key)
        self._controller_config = controller
        self._app_name = serve.get_replica_context().app_name
        threading.Thread(target=self._announce_ready, name="adaspec-ready", daemon=True).start()

    def _running_replicas(self) -> dict[str, int]:
        """Replicas RUNNING per model id, from Serve's controller (blocking: one actor call)."""
        app = serve.status().applications.get(self._app_name)
        deployments = app.deployments if app is not None else {}
        running = {}
        for model_id, handle in self._default_serve_handles.items():
            overview = deployments.get(handle.deployment_name)
            running[model_id] = overview.replica_states.get("RUNNING", 0)  # a str enum if overview else 0
        return running

    async def _not_ready(self) -> str | None:
        """Why the app cannot serve yet; None when it can."""
        return not_ready_reason(await asyncio.to_thread(self._running_replicas))

    def _announce_ready(self) -> None:
        """Log one line the first time the app can serve: what `serve run` users wait for."""
        while True:
            try:
                running = self._running_replicas()
            except Exception as e:  # noqa: BLE001 - Serve's controller busy or restarting: ask again
                logger.debug("adaspec: readiness not known yet: %r", e)
                running = None
            if running is not None and not_ready_reason(running) is None:
                logger.info("adaspec: ready to serve %s (%s); readiness route GET /health",
                            ", ".join(sorted(running)), ", ".join(f"{n} replica(s) of {m}" for m, n in running.items()))
                return
            time.sleep(READY_POLL_S)

    async def health(self):
        """200 when every model has a replica that can serve, else 503 with Retry-After."""
        if (reason := await self._not_ready()) is not None:
            return _unavailable(reason)
        return JSONResponse({"status": "ready"})

    async def _unready_admin(self) -> JSONResponse | None:
        """A 503 for an admin call while no replica can serve (starting, or replaced after its
        engine died), else None: a broadcast would wait for one, then fail."""
        reason = await self._not_ready()
        return None if reason is None else _unavailable(f"{reason}; admin routes answer once it can")

    async def _get_response(self, **kwargs):
        """Ray Serve LLM's call of a replica, made safe against a replica that dies, and
        refusing at once (HTTP 429, Retry-After) what finds every queue full:
        - before its first chunk, the request is sent again (Serve's router picks a live
          replica), up to REPLICA_RETRIES times: the client has received nothing yet; then
          HTTP 503 with Retry-After;
        - mid-stream, the stream ends with an OpenAI-style error event (then `[DONE]`),
          instead of a connection cut with no word of why."""
        for attempt in range(REPLICA_RETRIES + 1):
            sent = False
            try:
                async for chunk in super()._get_response(**kwargs):
                    sent = True
                    yield chunk
                return
            except BackPressureError:
                # Every replica full and the ingress's queue for them too (max_ongoing_requests,
                # max_queued_requests): refused at once, before the client got anything.
                raise StarletteHTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS, headers={"Retry-After": str(RETRY_AFTER_S)},
                    detail=f"the server is at capacity: every replica is full, and so is the queue in front of "
                           f"them (max_queued_requests); retry in {RETRY_AFTER_S} s") from None
            except REPLICA_LOST as e:
                what = "engine died" if isinstance(e, EngineDeadError) else f"replica was lost ({type(e).__name__})"
                if sent:
                    logger.warning("adaspec: %s mid-stream: %r", what, e)
                    yield _stream_error(f"the {what} mid-stream; Serve replaces it")
                    return
                if attempt == REPLICA_RETRIES:
                    raise StarletteHTTPException(
                        status.HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": str(RETRY_AFTER_S)},
                        detail=f"the replica serving this request: {what}; Serve replaces it, retry in "
                               f"{RETRY_AFTER_S} s") from None
                logger.warning("adaspec: %s before the first token, retrying (%d): %r", what, attempt + 1, e)

    async def _get_model_id(self, model: str | None) -> str:
        # Ray's ingress answers an unknown model with FastAPI's {"detail": ...}; clients of
        # the OpenAI API expect {"error": {...}}.
        if model is not None and model not in self._model_cards:
            base = get_base_model_id(model)
            why = (f": `{base}` is served without LoRA adapters (adaspec refuses lora_config)"
                   if base != model and base in self._model_cards else "")
            raise OpenAIHTTPException(
                status_code=status.HTTP_404_NOT_FOUND, type="NotFoundError",
                message=f"The model `{model}` does not exist{why}. Available: {sorted(self._model_cards)}")
        return await super()._get_model_id(model)

    def _check_admin(self, request: Request) -> None:
        self._admin.check(request)

    def _check_model(self, model: str | None) -> None:
        """A 404 in OpenAI's shape for an admin call naming a model this app does not serve."""
        if model is not None and model not in self._default_serve_handles:
            raise OpenAIHTTPException(status_code=status.HTTP_404_NOT_FOUND, type="NotFoundError",
                                      message=f"no model {model!r} in this app; models: "
                                              f"{sorted(self._default_serve_handles)}")

    async def _broadcast(self, method: str, *args, model: str | None = None) -> list:
        """One call of `method` on every replica (of `model`, when given)."""
        self._check_model(model)
        results = []
        for model_id, handle in self._default_serve_handles.items():
            if model is not None and model_id != model:
                continue
            # broadcast() blocks on ray.get; keep the ingress event loop free.
            results += await asyncio.to_thread(broadcast, handle, method, args)
        return results

    async def admin_status(self, request: Request, model: str | None = None):
        self._check_admin(request)
        if (unready := await self._unready_admin()) is not None:
            return unready
        reports = await self._broadcast("telemetry", model=model)
        return [r.model_dump(mode="json") for r in reports]

    async def admin_policy(self, body: PolicyRequest, request: Request):
        self._check_admin(request)
        if (unready := await self._unready_admin()) is not None:
            return unready
        version = body.version if body.version is not None else new_policy_version()
        try:
            policy = SpecPolicy.parse(body.table, version=version, replica_id=body.replica_id)
        except (PolicyError, ValueError) as e:
            raise OpenAIHTTPException(status_code=400, type="BadRequestError", message=str(e))
        if len(policy.rules) > MAX_POLICY_RULES:
            raise OpenAIHTTPException(status_code=400, type="BadRequestError",
                                      message=f"a policy has at most {MAX_POLICY_RULES} rules; this one has "
                                              f"{len(policy.rules)}")
        acks = await self._broadcast("apply_policy", policy, model=body.model)
        if body.replica_id is not None and all(a.status == "not_this_replica" for a in acks):
            raise OpenAIHTTPException(status_code=404, type="NotFoundError",
                                      message=f"no replica {body.replica_id}; replicas: {sorted(a.replica_id for a in acks)}")
        return [a.model_dump(mode="json") for a in acks]


    async def _controller(self):
        from controller.actor import get_controller, get_or_create_controller

        if self._controller_config is not None and self._controller_config.enabled:
            # The replicas create the controller at their first control period; an admin call
            # just after start must not find it missing, so whoever comes first creates it.
            return await asyncio.to_thread(get_or_create_controller, self._controller_config)
        try:
            return await asyncio.to_thread(get_controller)
        except ValueError:
            raise OpenAIHTTPException(
                status_code=status.HTTP_404_NOT_FOUND, type="NotFound",
                message="no adaspec controller is running; set controller.enabled: true") from None

    async def admin_controller(self, request: Request, model: str | None = None):
        self._check_admin(request)
        if (unready := await self._unready_admin()) is not None:
            return unready
        self._check_model(model)
        view = await (await self._controller()).view.remote()
        return _json_response(view if model is None else view.of_model(model))

    async def admin_controller_action(self, body: ControllerRequest, request: Request):
        self._check_admin(request)
        if (unready := await self._unready_admin()) is not None:
            return unready
        view = await (await self._controller()).set_paused.remote(body.action == "pause")
        return _json_response(view)


ENDPOINTS = {
    **{name: DEFAULT_ENDPOINTS[name] for name in OPENAI_ROUTES},
    "health": lambda app: app.get("/health"),
    "admin_status": lambda app: app.get("/admin/status"),
    "admin_policy": lambda app: app.post("/admin/policy"),
    "admin_controller": lambda app: app.get("/admin/controller"),
    "admin_controller_action": lambda app: app.post("/admin/controller"),
}
