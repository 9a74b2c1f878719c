"""serve_app/request_checks.py without a server: which bodies are refused before the routes
read them, and which are left to the routes' own 400s."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import Request

from serve_app.config import ApiKeySource
from serve_app.ray_llm import ChatCompletionRequest, CompletionRequest
from serve_app.request_checks import body_problem, invalid_unicode_at

MODEL = "m"


def test_a_lone_surrogate_is_found_where_it_is():
    assert invalid_unicode_at(json.loads('{"a": [1, {"b": "x\\ud800"}]}')) == "body.a[1].b"
    assert invalid_unicode_at(json.loads('{"k\\udfff": 1}')) == "body key 'k\\udfff'"
    # A surrogate pair is one valid character; an escaped backslash is no escape at all.
    assert invalid_unicode_at(json.loads('{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}')) is None


@pytest.mark.parametrize("raw,model,needle", [
    ('{"model": "m", "prompt": "hi \\ud800"}', CompletionRequest, "body.prompt is not valid Unicode"),
    ('{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', ChatCompletionRequest,
     "body.messages[0].content is not valid Unicode"),
    ('{"model": "m", "prompt": "hi", "temperature": NaN}', CompletionRequest, "NaN is not a JSON number"),
    ('{"model": "m", "prompt": "hi", "stop": [-Infinity]}', CompletionRequest, "-Infinity is not a JSON number"),
    ('{"model": "m", "prompt": "hi", "structured_outputs": [1]}', CompletionRequest, "wrong type"),
    ('{"model": "m", "messages": [], "structured_outputs": 0.5}', ChatCompletionRequest, "wrong type"),
    ('{"table": "\\ud800"}', None, "body.table is not valid Unicode"),
])
def test_bodies_the_routes_would_fail_on_are_refused(raw, model, needle):
    problem = body_problem(raw.encode(), model)
    assert problem is not None and needle in problem, problem


@pytest.mark.parametrize("raw,model", [
    ('{"model": "m", "prompt": "hi", "max_tokens": 4}', CompletionRequest),  # valid
    ('{"model": "m", "prompt": "hi \\ud83d\\ude00"}', CompletionRequest),  # valid, with an emoji
    ('{"model": "m", "prompt": 5}', CompletionRequest),  # the route names the field
    ('{"model": "m", "prompt": ', CompletionRequest),  # not JSON: the route says so
    ('[' * 100_000 + ']' * 100_000, CompletionRequest),  # nested too deeply: the route says so
])
def test_bodies_the_routes_answer_themselves_pass(raw, model):
    assert body_problem(raw.encode(), model) is None
    assert body_problem(b'{"model": "m", "prompt": "\xff"}', model) is None  # not UTF-8: the route says so


# The ingress's own request checks, through its FastAPI app without Ray or an engine: the app
# serve_app/builder.py serves (ingress_app(): the middleware that refuses unservable bodies,
# FastAPI's errors in OpenAI's shape, Ray Serve LLM's 400 for a body its request models refuse)
# with the OpenAI routes registered as Ray Serve LLM registers them, on handlers that accept
# whatever gets through. The checks that need the engine or the router (an unknown model,
# sampling parameters vLLM refuses, a prompt beyond the context) run through the real server
# in tests/test_serve_app.py::test_bad_input_through_the_real_server_gets_an_openai_error.
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
INGRESS_REFUSES = [
    # name, path, raw body (str, bytes) or JSON body (None: a GET), status, text the message must contain
    ("malformed_json", "/v1/completions", '{"model": "m", "prompt": ', 400, "JSON"),
    ("missing_prompt", "/v1/completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
    ("missing_messages", "/v1/chat/completions", {"model": MODEL, "max_tokens": 4}, 400, "messages"),
    ("prompt_wrong_type", "/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("messages_wrong_type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("max_tokens_wrong_type", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "x"}, 400, "max_tokens"),
    ("empty_prompt", "/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "prompt"),
    # Strings that are not Unicode: JSON's \ud800 escape decodes to a lone surrogate.
    ("surrogate_in_prompt", "/v1/completions",
     '{"model": "%s", "prompt": "hi \\ud800 there", "max_tokens": 2}' % MODEL, 400, "body.prompt is not valid Unicode"),
    ("surrogate_in_message", "/v1/chat/completions",
     '{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}' % MODEL, 400,
     "body.messages[0].content is not valid Unicode"),
    ("surrogate_in_stop", "/v1/completions",
     '{"model": "%s", "prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}' % MODEL, 400, "body.stop[0]"),
    ("surrogate_in_model", "/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}', 400,
     "body.model is not valid Unicode"),
    ("body_not_utf8", "/v1/completions", b'{"model": "m", "prompt": "\xff\xfe", "max_tokens": 2}', 400, "UTF-8"),
    ("deeply_nested", "/v1/completions",
     '{"model": "%s", "prompt": %s, "max_tokens": 2}' % (MODEL, "[" * 100_000 + "]" * 100_000), 400, "nested"),
    ("huge_stop_array", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "stop": [f"x{i}" for i in range(100_000)], "max_tokens": 2}, 400, "stop"),
    ("temperature_nan", "/v1/completions",
     '{"model": "%s", "prompt": "hi", "temperature": NaN, "max_tokens": 2}' % MODEL, 400, "NaN is not a JSON number"),
    ("structured_outputs_not_an_object", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "structured_outputs": [1], "max_tokens": 2}, 400, "wrong type"),
    ("seed_beyond_int64", "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**80, "max_tokens": 2}, 400,
     "seed"),
    ("unknown_route", "/v1/no-such-route", {"model": MODEL}, 404, "not found"),
    ("wrong_method", "/v1/completions", None, 405, "method not allowed"),
]


def _ingress_app(api_key: ApiKeySource | None = None):
    """ingress_app() with the OpenAI routes and /health registered as the ingress registers
    them, on handlers that accept whatever gets through."""
    from serve_app.ingress import ENDPOINTS, ingress_app

    app = ingress_app(api_key)

    # FastAPI reads these annotations as the route's parameters (`Request` is imported at
    # module level: under `from __future__ import annotations` they are resolved there).
    async def completions(body: CompletionRequest, request: Request) -> dict:  # OpenAiIngress.completions' signature
        return {"served": True}

    async def chat(body: ChatCompletionRequest, request: Request) -> dict:  # OpenAiIngress.chat's signature
        return {"served": True}

    async def models() -> dict:  # OpenAiIngress.models answers a ModelList
        return {"object": "list", "data": []}

    async def health() -> dict:
        return {"status": "ready"}

    ENDPOINTS["completions"](app)(completions)
    ENDPOINTS["chat"](app)(chat)
    ENDPOINTS["models"](app)(models)
    ENDPOINTS["health"](app)(health)
    return app


@pytest.fixture(scope="module")
def ingress():
    from fastapi.testclient import TestClient

    with TestClient(_ingress_app(), raise_server_exceptions=False) as client:
        yield client


def send(client, path: str, body):
    """GET `path` when `body` is None, else POST a raw body (str, bytes) or a JSON one."""
    if body is None:
        return client.get(path, timeout=60)
    if isinstance(body, (str, bytes)):
        return client.post(path, content=body, headers={"content-type": "application/json"}, timeout=60)
    return client.post(path, json=body, timeout=60)


@pytest.mark.parametrize("name,path,body,status,needle", INGRESS_REFUSES, ids=[b[0] for b in INGRESS_REFUSES])
def test_the_ingress_refuses_bad_input_with_an_openai_error(ingress, name, path, body, status, needle):
    resp = send(ingress, path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]  # the OpenAI error shape: {"error": {"message", "type", ...}}
    assert needle.lower() in error["message"].lower(), error
    assert error["type"]


def test_the_ingress_passes_a_valid_body_to_its_route(ingress):
    """The table above fails for the right reason: the same app serves a valid body."""
    for path, body in [("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4})]:
        resp = send(ingress, path, body)
        assert resp.status_code == 200 and resp.json() == {"served": True}, resp.text


def test_without_an_api_key_the_openai_routes_are_open(ingress):
    """No api_key, no api_key_env: every route answers without a header, as before."""
    assert ingress.get("/v1/models").status_code == 200
    assert ingress.get("/health").status_code == 200


# The API key (serve_app/api_key.py): the same app, built with a key, as build_app builds it
# for `api_key` / `api_key_env`. vLLM's --api-key guards every path under /v1, /v1/models
# included, and leaves /health and OPTIONS (CORS preflights) alone; adaspec answers in
# OpenAI's error shape with a WWW-Authenticate challenge.
API_KEY = "sk-adaspec-test-Key"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
BEARER = 'Bearer realm="adaspec"'
INVALID = 'Bearer realm="adaspec", error="invalid_token"'
API_KEY_CHECKS = [
    # name, method, path, JSON body, Authorization header (None: none sent), status, WWW-Authenticate
    ("no_header", "POST", "/v1/completions", COMPLETION, None, 401, BEARER),
    ("no_header_chat", "POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT}, None, 401, BEARER),
    ("no_header_models", "GET", "/v1/models", None, None, 401, BEARER),  # vLLM guards it too
    ("empty_header", "POST", "/v1/completions", COMPLETION, "", 401, BEARER),
    ("other_scheme", "POST", "/v1/completions", COMPLETION, f"Basic {API_KEY}", 401, BEARER),
    ("key_alone", "POST", "/v1/completions", COMPLETION, API_KEY, 401, BEARER),
    ("wrong_key", "POST", "/v1/completions", COMPLETION, "Bearer sk-wrong", 401, INVALID),
    ("empty_key", "POST", "/v1/completions", COMPLETION, "Bearer ", 401, INVALID),
    ("key_case_differs", "POST", "/v1/completions", COMPLETION, f"Bearer {API_KEY.lower()}", 401, INVALID),
    ("key_with_a_suffix", "POST", "/v1/completions", COMPLETION, f"Bearer {API_KEY}x", 401, INVALID),
    ("key_prefix", "POST", "/v1/completions", COMPLETION, f"Bearer {API_KEY[:-1]}", 401, INVALID),
    # Refused before anything else looks at the request: no 404 or 400 tells a caller
    # without the key which routes exist or how their bodies are parsed.
    ("unknown_route", "GET", "/v1/no-such-route", None, None, 401, BEARER),
    ("malformed_body", "POST", "/v1/completions", '{"model": ', None, 401, BEARER),
    ("right_key", "POST", "/v1/completions", COMPLETION, f"Bearer {API_KEY}", 200, None),
    ("right_key_chat", "POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT},
     f"Bearer {API_KEY}", 200, None),
    ("right_key_models", "GET", "/v1/models", None, f"Bearer {API_KEY}", 200, None),
    ("scheme_in_lower_case", "POST", "/v1/completions", COMPLETION, f"bearer {API_KEY}", 200, None),
    ("health_needs_no_key", "GET", "/health", None, None, 200, None),
    ("wrong_key_on_health", "GET", "/health", None, "Bearer sk-wrong", 200, None),
    ("admin_has_its_own_token", "GET", "/admin/no-such-route", None, None, 404, None),
]


@pytest.fixture(scope="module")
def keyed_ingress():
    from fastapi.testclient import TestClient

    with TestClient(_ingress_app(ApiKeySource(key=API_KEY)), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("name,method,path,body,authorization,status,challenge", API_KEY_CHECKS,
                         ids=[c[0] for c in API_KEY_CHECKS])
def test_the_api_key_guards_the_openai_routes(keyed_ingress, name, method, path, body, authorization, status,
                                              challenge):
    headers = {} if authorization is None else {"Authorization": authorization}
    if isinstance(body, str):
        headers["content-type"] = "application/json"
        resp = keyed_ingress.request(method, path, content=body, headers=headers)
    else:
        resp = keyed_ingress.request(method, path, json=body, headers=headers)
    assert resp.status_code == status, resp.text
    assert resp.headers.get("www-authenticate") == challenge
    if status == 401:
        # OpenAI's error shape, the type OpenAI's SDK raises for a 401; the key sent is never echoed.
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "AuthenticationError" and error["code"] == 401 and error["param"] is None
        assert "API key" in error["message"] or "Bearer" in error["message"], error
        assert API_KEY not in resp.text and "sk-wrong" not in resp.text


def test_the_401_body_is_exactly_openais_shape(keyed_ingress):
    resp = keyed_ingress.post("/v1/completions", json=COMPLETION)
    assert resp.json() == {"error": {
        "message": "the OpenAI routes need an API key: send the header `Authorization: Bearer <key>` (OpenAI "
                   "clients: api_key=<key>)",
        "type": "AuthenticationError", "param": None, "code": 401}}
    assert resp.headers["content-type"] == "application/json"
    resp = keyed_ingress.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer nope"})
    assert resp.json() == {"error": {"message": "incorrect API key provided", "type": "AuthenticationError",
                                     "param": None, "code": 401}}


def test_a_cors_preflight_passes_without_the_key(keyed_ingress):
    """Browsers send OPTIONS without credentials before the real request (vLLM lets it pass)."""
    resp = keyed_ingress.options("/v1/chat/completions", headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert resp.status_code == 200, resp.text
    assert "access-control-allow-origin" in resp.headers


def test_the_key_is_compared_in_constant_time(keyed_ingress, monkeypatch):
    """Every key sent goes through hmac.compare_digest, as equal-length SHA-256 digests: the
    time a refusal takes says nothing about how much of a guess matched, or the key's length."""
    import hmac

    import serve_app.api_key as api_key

    calls = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(api_key.hmac, "compare_digest", spy)
    for key, status in [(API_KEY, 200), ("sk-wrong", 401), (API_KEY * 10, 401)]:
        resp = keyed_ingress.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == status
    assert len(calls) == 3 and all(len(a) == len(b) == 32 for a, b in calls)


def test_the_key_from_an_environment_variable(monkeypatch):
    """api_key_env: read where the app runs (Starlette builds the middleware when the app
    starts), not when the config is validated."""
    from fastapi.testclient import TestClient

    source = ApiKeySource(env="ADASPEC_TEST_API_KEY")
    app = _ingress_app(source)  # built without the variable, as build_app on a deploying machine
    monkeypatch.setenv("ADASPEC_TEST_API_KEY", "from-a-secret")
    with TestClient(app) as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer from-a-secret"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
        assert client.get("/v1/models").status_code == 401


@pytest.mark.parametrize("value", [None, ""])
def test_an_unset_key_variable_fails_the_ingress_at_start(monkeypatch, value):
    """An unset or empty variable stops the ingress naming the field, rather than serving the
    routes open while the config says they are closed."""
    from fastapi.testclient import TestClient

    from serve_app.ingress import check_api_key_source

    if value is None:
        monkeypatch.delenv("ADASPEC_TEST_API_KEY", raising=False)
    else:
        monkeypatch.setenv("ADASPEC_TEST_API_KEY", value)
    source = ApiKeySource(env="ADASPEC_TEST_API_KEY")
    with pytest.raises(ValueError, match=r"^api_key_env: the environment variable ADASPEC_TEST_API_KEY is unset"):
        check_api_key_source(source)  # what AdaspecIngress.__init__ calls
    with pytest.raises(ValueError, match=r"^api_key_env: "):
        with TestClient(_ingress_app(source)):  # and the middleware itself, should it be built first
            pass


def test_vllm_api_key_alone_warns_that_the_routes_are_open(monkeypatch):
    """A vLLM user's VLLM_API_KEY is not read unless the config names it (Ray Serve LLM does
    not read it either); the ingress says so rather than serving open routes silently."""
    import serve_app.ingress as ingress

    warnings = []
    monkeypatch.setattr(ingress.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    ingress.check_api_key_source(None, {"VLLM_API_KEY": "k"})
    assert len(warnings) == 1 and "api_key_env: VLLM_API_KEY" in warnings[0]
    ingress.check_api_key_source(None, {})
    ingress.check_api_key_source(ApiKeySource(env="VLLM_API_KEY"), {"VLLM_API_KEY": "k"})
    assert len(warnings) == 1


def test_the_guarded_prefix_is_the_apps_own_under_serves_route_prefix():
    """Serve mounts the app under its route_prefix (scope root_path); /v1 is matched after it."""
    from serve_app.api_key import ApiKeyCheck

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    check = ApiKeyCheck(app, ApiKeySource(key=API_KEY))
    for path in ["/adaspec/v1/models", "/adaspec/health"]:
        asyncio.run(check({"type": "http", "method": "GET", "path": path, "root_path": "/adaspec", "headers": []},
                          receive, send))
    assert reached == ["/adaspec/health"]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
