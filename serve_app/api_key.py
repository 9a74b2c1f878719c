"""The API key of the OpenAI routes (`api_key`, or the variable `api_key_env` names).

vLLM's convention (`vllm serve --api-key`, or VLLM_API_KEY; vllm/entrypoints/serve/middleware/
authenticate.py in vLLM 0.32), which OpenAI clients already follow (`OpenAI(api_key=...)`
sends `Authorization: Bearer <key>`):
- every request whose path starts with /v1 needs `Authorization: Bearer <key>`, /v1/models
  included; the scheme's case does not matter ("bearer" passes), the key's does;
- OPTIONS requests pass, so browsers' CORS preflights (which carry no credentials) work;
- paths outside /v1 pass: /health (a load balancer's or Kubernetes' probe has no key) and
  /admin, which has its own token (serve_app/admin_guard.py).
Ray Serve LLM 2.60 has no API key of its own: its OpenAI ingress ignores the header (its
examples send `api_key="fake-key"`), so a config moved from it loses nothing.

Where adaspec differs from vLLM: a refusal is 401 with OpenAI's error body
(`{"error": {"message", "type": "AuthenticationError", "param": null, "code": 401}}`, the
shape of every other adaspec error and the type OpenAI's SDK raises for a 401) instead of
vLLM's `{"error": "Unauthorized"}`, and carries `WWW-Authenticate: Bearer ...` (RFC 6750)
so a client knows which scheme to send. One key, not vLLM's list.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.config import ApiKeySource
from serve_app.ray_llm import ErrorInfo, ErrorResponse

GUARDED_PREFIX = "/v1"  # vLLM's prefix (it also guards /v2, /inference, /cohere: routes adaspec does not serve)
REALM = 'Bearer realm="adaspec"'
MISSING = ("the OpenAI routes need an API key: send the header `Authorization: Bearer <key>` (OpenAI clients: "
           "api_key=<key>)")
NOT_BEARER = "the Authorization header must use the Bearer scheme: `Authorization: Bearer <key>`"
WRONG = "incorrect API key provided"  # never echoes the key sent: it may be another service's secret


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def is_guarded(path: str) -> bool:
    """Whether a request path (without Serve's route prefix) needs the API key."""
    return path.startswith(GUARDED_PREFIX)


def unauthorized(message: str, invalid_token: bool) -> JSONResponse:
    """The 401 answer: OpenAI's error body, and the scheme to use in WWW-Authenticate (with
    RFC 6750's `error="invalid_token"` when a key was sent but is wrong)."""
    body = ErrorResponse(error=ErrorInfo(message=message, type="AuthenticationError", code=401))
    challenge = f'{REALM}, error="invalid_token"' if invalid_token else REALM
    return JSONResponse(body.model_dump(), status_code=401, headers={"WWW-Authenticate": challenge})


class ApiKeyCheck:
    """Pure ASGI middleware refusing /v1 requests without the API key (module docstring).

    Built by Starlette when the app first runs, so in the ingress's own process, which is
    where the key's variable is set; AdaspecIngress resolves the same source before that, so
    a missing variable fails the deployment at start instead of the first request."""

    def __init__(self, app: ASGIApp, source: ApiKeySource):
        self.app = app
        # Both sides hashed: compare_digest then compares equal lengths, so neither the
        # key's length nor how much of a guess matched shows in the time a refusal takes.
        self._expected = _digest(source.resolve())

    def refusal(self, headers: Headers) -> JSONResponse | None:
        """The 401 for a request with these headers; None when it carries the key."""
        value = headers.get("authorization")
        if not value:
            return unauthorized(MISSING, invalid_token=False)
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer":
            return unauthorized(NOT_BEARER, invalid_token=False)
        if not hmac.compare_digest(_digest(key), self._expected):
            return unauthorized(WRONG, invalid_token=True)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)  # lifespan events; CORS preflights
            return
        # Serve mounts the app under the route prefix; the guarded prefix is the app's own.
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        refusal = self.refusal(Headers(scope=scope)) if is_guarded(path) else None
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation: no HTTP body to send
        else:
            await refusal(scope, receive, send)
