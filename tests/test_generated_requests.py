"""Generated requests against the default app, through the real stack: a valid completion or
chat request with one to three of its fields replaced by arbitrary JSON (wrong types, values
out of range, lone UTF-16 surrogates, nested lists and objects, NaN and infinities) must get
either a response or an OpenAI-style 4xx error: never a 5xx, never a hang.

Bounded: a fixed number of examples, derandomized (the same requests every run), each with a
timeout; fields that could make a valid request long (max_tokens, n, ...) get either small
valid values or invalid ones.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from serve_app.ray_llm import ChatCompletionRequest, CompletionRequest
from testkit.clients import MODEL

pytestmark = pytest.mark.slow

EXAMPLES = 300
REQUEST_TIMEOUT_S = 60.0

BASES = {
    "/v1/completions": ({"model": MODEL, "prompt": "Say hi.", "max_tokens": 2}, sorted(CompletionRequest.model_fields)),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2},
                             sorted(ChatCompletionRequest.model_fields)),
}
# Fields whose valid values can make a request run long: small valid values or invalid ones.
LENGTHY = {"max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "thinking_token_budget"}

# Text with lone surrogates among ordinary characters (hypothesis' text() rarely makes them).
texts = st.one_of(st.text(max_size=12), st.text(alphabet=st.sampled_from(["a", " ", "\ud800", "\udfff", "é", "😀"]),
                                                max_size=6))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(texts, inner, max_size=4)), max_leaves=8)
# Beyond 2**15 is invalid for each: max_model_len is 2048, vLLM caps n at 16384.
lengthy_values = st.one_of(st.integers(1, 3), st.integers(-2**70, 0), st.integers(2**15, 2**70),
                           json_values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)))


@st.composite
def requests(draw) -> tuple[str, str]:
    """(path, JSON body): a valid base request with 1-3 fields replaced."""
    path = draw(st.sampled_from(sorted(BASES)))
    base, fields = BASES[path]
    body = dict(base)
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        body[field] = draw(lengthy_values if field in LENGTHY else json_values)
    # ensure_ascii writes a lone surrogate as its \ud800 escape (valid JSON text); allow_nan
    # writes NaN and Infinity, which the server must refuse.
    return path, json.dumps(body, ensure_ascii=True, allow_nan=True)


def send_generated_requests(base_url: str, examples: int = EXAMPLES) -> collections.Counter:
    """Send `examples` generated requests; assert each outcome; return status -> count."""
    outcomes: collections.Counter = collections.Counter()
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(requests())
        def send(request: tuple[str, str]) -> None:
            path, body = request
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
            outcomes[resp.status_code] += 1
            assert resp.status_code < 500, f"{resp.status_code} for {body[:300]}: {resp.text[:300]}"
            if resp.status_code >= 400:
                error = resp.json().get("error")  # the OpenAI error shape
                assert isinstance(error, dict) and error.get("message") and error.get("type"), resp.text[:300]

        send()
    return outcomes


def test_generated_requests_get_a_response_or_an_openai_4xx_never_a_5xx(server):
    outcomes = send_generated_requests(server.url)
    print(f"\n[generated requests] {sum(outcomes.values())} sent; by status: {dict(sorted(outcomes.items()))}")
    # Both paths exercised: some requests served, some refused.
    assert outcomes[200] > 0 and sum(n for status, n in outcomes.items() if 400 <= status < 500) > 0, outcomes
