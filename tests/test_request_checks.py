"""serve_app/request_checks.py without a server: which bodies are refused before the routes
read them, and which are left to the routes' own 400s."""

from __future__ import annotations

import json

import pytest
from fastapi import Request

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


@pytest.fixture(scope="module")
def ingress():
    from fastapi.testclient import TestClient

    from serve_app.ingress import ENDPOINTS, ingress_app

    app = ingress_app()

    # FastAPI reads these annotations as the route's parameters (`Request` is imported at
    # module level: under `from __future__ import annotations` they are resolved there).
    async def completions(body: CompletionRequest, request: Request) -> dict:  # OpenAiIngress.completions' signature
        return {"served": True}

    async def chat(body: ChatCompletionRequest, request: Request) -> dict:  # OpenAiIngress.chat's signature
        return {"served": True}

    ENDPOINTS["completions"](app)(completions)
    ENDPOINTS["chat"](app)(chat)
    with TestClient(app, raise_server_exceptions=False) as client:
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
