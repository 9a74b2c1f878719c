"""The OpenAI API of the default app, through the real stack (issue: foundation)."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import time

import httpx
import openai
import pytest

from testkit.clients import MODEL, URL, complete, replica_status
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def _sse_text(resp: httpx.Response, chat: bool) -> str:
    assert resp.headers["content-type"].startswith("text/event-stream")
    text, done = [], False
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        choice = json.loads(data)["choices"][0]
        text.append((choice.get("delta") or {}).get("content") or "" if chat else choice["text"])
    assert done, "stream did not end with [DONE]"
    return "".join(text)


def test_models_lists_the_served_model(client):
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == [MODEL]


def test_greedy_completion_knows_paris(client):
    out = complete(client, "The capital of France is", max_tokens=8)
    assert "Paris" in out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] <= 8


def test_chat_completion(client):
    resp = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert "Paris" in message["content"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_delivers_the_same_text(client, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0,
            **({"messages": CHAT} if chat else {"prompt": "The capital of France is"})}
    plain = client.post(path, json=body).json()["choices"][0]
    plain_text = plain["message"]["content"] if chat else plain["text"]
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        streamed = _sse_text(resp, chat)
    assert streamed == plain_text
    assert streamed


def test_readiness_told_the_truth_while_the_server_started(server):
    """While the engine started (conftest's server fixture probed every 3 s until a
    completion succeeded): GET /health answered 503 with Retry-After, and 200 only when a
    completion then succeeded; admin routes answered 503 with Retry-After, never a 500 or a
    hang; the app logged one line when ready. Before the app exists, Serve's proxy answers 404
    (nothing listens before that)."""
    probes = server.startup
    assert probes and probes[-1].completion[0] == 200
    health = [p.health for p in probes]
    assert any(status == 503 for status, _ in health), probes
    for p in probes:
        assert p.health[0] in (None, 404, 503, 200), p
        assert p.admin[0] in (None, 404, 503, 200), p
        for status, retry_after in (p.health, p.admin):
            assert status != 503 or (retry_after and int(retry_after) > 0), p
        if p.health[0] == 200:  # ready means a completion succeeds
            assert p.completion[0] == 200, p
    assert httpx.get(f"{URL}/health", timeout=10).json() == {"status": "ready"}
    ready_lines = [line for line in server.log_path.read_text(errors="replace").splitlines()
                   if "adaspec: ready to serve" in line]
    assert len(ready_lines) == 1, ready_lines
    print(f"\n[readiness] {len(probes)} probes over {server.ready_s:.0f} s; /health answered "
          f"{collections.Counter(s for s, _ in health)}; admin {collections.Counter(p.admin[0] for p in probes)}")


def test_official_openai_client(server):
    oai = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused")
    assert MODEL in [m.id for m in oai.models.list()]
    comp = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in comp.choices[0].text
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    stream = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)


LONG_PROMPT = "hello " * 3000  # > 2048 tokens (max_model_len in configs/app.yaml)
# Bad input the ingress refuses by itself (bodies it cannot parse or serve, wrong types, unknown
# routes) is checked without a server, case by case, in
# tests/test_request_checks.py::test_the_ingress_refuses_bad_input_with_an_openai_error; three
# of those cases run here too, through the real stack. The rest need the engine or the router.
BAD_INPUTS = [
    # name, path, raw body (str, bytes) or JSON body (None: a GET), status, text the message must contain
    # The ingress's own checks, as served.
    ("malformed_json", "/v1/completions", '{"model": "m", "prompt": ', 400, "JSON"),
    ("surrogate_in_prompt", "/v1/completions",
     '{"model": "%s", "prompt": "hi \\ud800 there", "max_tokens": 2}' % MODEL, 400, "body.prompt is not valid Unicode"),
    ("wrong_method", "/v1/completions", None, 405, "method not allowed"),
    # Checks that need the router (the model) or the engine (sampling parameters, the context).
    ("max_tokens_zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens_negative", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens_beyond_context", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("negative_temperature", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": -0.5}, 400, "temperature"),
    ("top_p_zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "top_p": 0}, 400, "top_p"),
    ("top_p_above_one", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "max_tokens": 4, "top_p": 1.5}, 400, "top_p"),
    ("unknown_model", "/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "no-such-model"),
    ("unknown_model_chat", "/v1/chat/completions", {"model": "no-such-model", "messages": CHAT}, 404, "no-such-model"),
    # A LoRA id of the served model (Ray Serve LLM's `base:adapter`): no adapter is served, and the 404 says so.
    ("lora_adapter", "/v1/completions", {"model": f"{MODEL}:my-adapter", "prompt": "hi"}, 404,
     "served without LoRA adapters"),
    ("prompt_beyond_context", "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}, 400, "context"),
    ("prompt_beyond_context_stream", "/v1/completions",
     {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "stream": True}, 400, "context"),
    ("empty_messages", "/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 4}, 400, "empty"),
    ("huge_token_array", "/v1/completions", {"model": MODEL, "prompt": list(range(200_000)), "max_tokens": 2}, 400,
     "context"),
    ("huge_logit_bias", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(100_000)}, "max_tokens": 2}, 400,
     "token_id"),
    ("n_huge", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 10**6, "max_tokens": 2}, 400, "n must"),
]


@pytest.mark.parametrize("name,path,body,status,needle", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_through_the_real_server_gets_an_openai_error(client, name, path, body, status, needle):
    if body is None:
        resp = client.get(path, timeout=60)
    elif isinstance(body, (str, bytes)):
        resp = client.post(path, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        resp = client.post(path, json=body, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]  # the OpenAI error shape: {"error": {"message", "type", ...}}
    assert needle.lower() in error["message"].lower(), error
    assert error["type"]


def _gauge(metrics: str, name: str) -> float | None:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)]
    return sum(values) if values else None


def test_clients_that_go_away_free_their_engine_slots(server, client):
    """20 streaming clients that close mid-stream and 20 non-streaming ones that time out:
    vLLM aborts all 40 (Serve cancels a request whose client disconnected), the running batch
    returns to 0 and the KV cache empties, and none of them is in the replica's request
    records (an aborted request's latency says nothing about the engine)."""
    since = time.time()
    body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}

    def stream_then_drop(_):
        with httpx.stream("POST", f"{URL}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    return True  # one chunk, then the connection closes
        return False

    def time_out(_):
        try:
            httpx.post(f"{URL}/v1/completions", json=body, timeout=httpx.Timeout(120, read=3.0))
        except httpx.ReadTimeout:
            return True
        return False

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        dropped = list(pool.map(stream_then_drop, range(20)))
        timed_out = list(pool.map(time_out, range(20)))
    assert all(dropped) and all(timed_out), (dropped, timed_out)

    def idle():
        (replica,) = replica_status(client)
        return replica if replica["running"] == 0 and replica["queue_length"] == 0 else None

    wait_until(idle, "the engine's running batch and queue emptying after 40 clients went away", 60)
    wait_until(lambda: _gauge(server.metrics_text(), "ray_vllm_kv_cache_usage_perc") == 0.0,
               "vLLM's KV cache usage back to 0", 60)
    complete(client, "Hello", max_tokens=4)  # a request that finishes: the records do show those
    (replica,) = replica_status(client)
    kept = [r for r in replica["requests"] if r["arrival_time"] >= since]
    assert [r["output_tokens"] for r in kept] == [4], f"aborted requests recorded as finished: {kept[:3]}"
    print("\n[disconnects] 20 dropped streams + 20 timed-out requests: engine idle, KV cache usage 0, "
          "none of them in the request records, the finished one after them is")
