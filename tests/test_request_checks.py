"""serve_app/request_checks.py without a server: which bodies are refused before the routes
read them, and which are left to the routes' own 400s."""

from __future__ import annotations

import json

import pytest

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
