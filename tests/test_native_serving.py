"""The native tree engine served by the app (issue 6, phase 2), through the real stack.

One server per module, started as a user would: `serve run configs/app-tree.yaml` (Ray
Serve, the native engine, SmolLM2-135M, n-gram trees, controller and admin on, port 8001),
in its own local Ray cluster so it can run beside the default app of tests/conftest.py.
Run it under `flock /tmp/adaspec-8001.lock` when others share the machine.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from adaspec.policy import SpecConfig, SpecPolicy
from controller.policy_search import TREE_SHAPES
from native_engine.requests import SamplingParams
from testkit.apps import app_in_own_cluster
from testkit.clients import MODEL, replica_status, set_controller
from testkit.metrics import counter_sums, settled
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

PORT = 8001  # configs/app-tree.yaml's http_options
URL = f"http://127.0.0.1:{PORT}"
TREE_TABLE = "1-2:tree4x2x2,3+:chain2"
# Repeats itself, so n-gram prompt lookup finds continuations to draft.
REPETITIVE = "one two three four five six, one two three four five six, one two three four"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tree_server(tmp_path_factory):
    with app_in_own_cluster("app-tree.yaml", PORT, tmp_path_factory.mktemp("serve-tree"), "tree server") as proc:
        yield proc


@pytest.fixture
def client(tree_server):
    with httpx.Client(base_url=URL, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def reference_engine():
    """The same model in this process, for token-for-token comparisons."""
    import torch

    from native_engine.engine import EngineConfig, NativeEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # leave a core to the server
    yield NativeEngine.from_pretrained(MODEL, drafter="none", config=EngineConfig(max_batch_size=1, max_seq_len=256))
    torch.set_num_threads(threads)


def _status(client: httpx.Client) -> dict:
    (replica,) = replica_status(client)
    return replica


def _sse(resp: httpx.Response) -> tuple[str, list[str | None]]:
    """Concatenated chat deltas and the finish reasons of a chat stream."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    text, reasons, done = [], [], False
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        choice = json.loads(line[len("data: "):])["choices"][0]
        text.append(choice["delta"].get("content") or "")
        reasons.append(choice.get("finish_reason"))
    assert done, "stream did not end with [DONE]"
    return "".join(text), reasons


# ----------------------------------------------------------------------------------- OpenAI API
def test_the_replica_compiled_its_decode_pass_before_serving(tree_server):
    log = tree_server.log_path.read_text(errors="replace")
    compiled, started = log.find("adaspec: decode pass compiled in"), log.find("adaspec: native engine started")
    assert 0 <= compiled < started, tree_server.log_tail()


def test_models_lists_the_served_model(client):
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == [MODEL]


@pytest.mark.parametrize("prompt", ["The capital of France is", REPETITIVE])
def test_greedy_completion_equals_the_engine_run_directly(tree_server, reference_engine, prompt):
    """The replica's decode pass is compiled (configs/app-tree.yaml: compile_decode), the
    reference engine's eager: the same tokens."""
    api = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused")
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    ids = reference_engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert out.choices[0].text == reference_engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.prompt_tokens == len(reference_engine.tokenizer.encode(prompt).ids)
    assert out.choices[0].finish_reason == ("length" if len(ids) == 24 else "stop")


def test_chat_stream_concatenates_to_the_non_streamed_answer(client):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "temperature": 0}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and "Paris" in message["content"]
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        text, reasons = _sse(stream)
    assert text == message["content"]
    assert reasons[-1] == answer["choices"][0]["finish_reason"] and not any(reasons[:-1])


def test_stop_string_and_max_tokens_set_the_finish_reason(client):
    body = {"model": MODEL, "prompt": REPETITIVE, "temperature": 0}
    resp = client.post("/v1/completions", json={**body, "max_tokens": 3})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and resp.json()["usage"]["completion_tokens"] == 3
    resp = client.post("/v1/completions", json={**body, "max_tokens": 40, "stop": ["six"]})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "six" not in choice["text"]
    assert choice["text"].startswith(" five")  # the stop string is cut, what came before stays
    # Streamed, the stop string never shows up either (the tail is held back until it is ruled out).
    with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 40, "stop": ["six"], "stream": True}) as s:
        chunks = [json.loads(line[6:])["choices"][0] for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["finish_reason"] == "stop"


def test_seeded_sampling_repeats(client):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": 7}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == first


# vLLM's serving series, as the native replica exports them (serve_app/metrics.py), and what
# each must have counted for the requests sent.
NATIVE_COUNTERS = ["ray_vllm_e2e_request_latency_seconds_count", "ray_vllm_time_to_first_token_seconds_count",
                   "ray_vllm_request_time_per_output_token_seconds_count", "ray_vllm_prompt_tokens_total",
                   "ray_vllm_generation_tokens_total", "ray_vllm_spec_decode_num_drafts_total",
                   "ray_vllm_spec_decode_num_draft_tokens_total", "ray_vllm_spec_decode_num_accepted_tokens_total"]


def test_the_replica_exports_vllms_serving_and_spec_decode_metrics_counting_what_it_served(tree_server, client):
    """Under vLLM's names (one dashboard for both engines): per request one e2e latency, one
    TTFT and one TPOT sample, its prompt and output tokens; per step the drafts, draft tokens
    (a tree's nodes) and accepted tokens the replica's telemetry counted."""
    before = settled(tree_server, lambda text: counter_sums(text, NATIVE_COUNTERS), "the native replica's counters")
    since = time.time()
    usages = [client.post("/v1/completions", json={"model": MODEL, "prompt": f"{REPETITIVE}, {i}", "max_tokens": 16,
                                                   "temperature": 0, "ignore_eos": True}).json()["usage"]
              for i in range(4)]
    steps = [s for s in _status(client)["steps"] if s["time"] > since]
    expected = {
        "ray_vllm_e2e_request_latency_seconds_count": 4, "ray_vllm_time_to_first_token_seconds_count": 4,
        "ray_vllm_request_time_per_output_token_seconds_count": 4,
        "ray_vllm_prompt_tokens_total": sum(u["prompt_tokens"] for u in usages),
        "ray_vllm_generation_tokens_total": sum(u["completion_tokens"] for u in usages),
        "ray_vllm_spec_decode_num_drafts_total": sum(s["num_drafts"] for s in steps),
        "ray_vllm_spec_decode_num_draft_tokens_total": sum(sum(s["nodes_per_seq"]) for s in steps),
        "ray_vllm_spec_decode_num_accepted_tokens_total": sum(sum(s["accepted_per_pos"]) for s in steps),
    }
    assert expected["ray_vllm_spec_decode_num_accepted_tokens_total"] > 0, "nothing accepted: the check would be empty"

    def deltas() -> dict[str, float]:
        now = counter_sums(tree_server.metrics_text(), NATIVE_COUNTERS)
        return {name: now[name] - before[name] for name in NATIVE_COUNTERS}

    # Ray exports every 10 s: wait for the last counter to catch up, then all must match.
    wait_until(lambda: all(deltas()[n] >= v for n, v in expected.items()), "the counters catching up", 60)
    assert deltas() == pytest.approx(expected), (deltas(), expected)
    running = re.search(r'^ray_vllm_num_requests_running{([^}]*)} (\S+)$', tree_server.metrics_text(), re.M)
    assert running and 'deployment="' in running.group(1) and f'model_name="{MODEL}"' in running.group(1), running


@pytest.mark.parametrize("body,status", [
    ({"model": "no-such-model", "prompt": "Hi"}, 404),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": 5000}, 400),  # beyond max_model_len 1024
    ({"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400),
    ({"model": MODEL, "prompt": "Hi", "temperature": -1}, 400),
    ({"model": MODEL, "prompt": ""}, 400),
    ({"model": MODEL, "prompt": "Hi", "n": 2}, 400),
    ({"model": MODEL, "prompt": "word " * 1100, "max_tokens": 1}, 400),  # prompt beyond the window
], ids=["unknown-model", "max-tokens-too-large", "max-tokens-zero", "negative-temperature", "empty-prompt",
        "n-2", "prompt-too-long"])
def test_bad_requests_get_4xx_with_a_message(client, body, status):
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["message"]


def test_malformed_body_gets_400(client):
    """Ray Serve LLM's ingress answers a body its request models refuse with a 400 in the
    OpenAI error shape, naming what is wrong ("JSON decode error", the field)."""
    resp = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "json" in error["message"].lower() and error["type"], error
    resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": "not a list"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "messages" in error["message"] and error["type"], error


def test_client_disconnect_aborts_the_request(client):
    body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    since = time.time()
    with client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    wait_until(lambda: _status(client)["running"] == 0, "the engine stopping a request whose stream was closed",
               timeout_s=60)
    # Aborted, not finished: a request that ran to its 500 tokens would be recorded as finished.
    finished = [r for r in _status(client)["requests"] if r["finish_time"] > since]
    assert not finished, f"the closed stream's request ran to the end: {finished}"


def test_beyond_the_queue_bound_requests_get_429_at_once_and_the_rest_are_served(client):
    """configs/app-tree.yaml: max_num_seqs 8, so the replica holds 16 requests and the ingress
    queues 16 more (the defaults, 2 x max_num_seqs each). Of 40 streams, those beyond get HTTP
    429 with Retry-After in the OpenAI shape at once; every admitted one is served.

    Sent in two waves: 16 that fill the replica, then 24 once its batch runs. Serve counts a
    request as queued only while its router looks for a replica, not while a replica it was sent
    to decides whether to take it; 40 at once on a router that has not heard from the replica
    lately overshoot the bound (CI, loaded: 39 of 40 admitted). Once the router has seen the
    replica fill, the count holds. An admitted stream holds its slot (long, unread) until 8
    refusals are seen or a deadline: requests finishing would free slots and hide the bound.
    (Not /admin/status to see the replica fill: it waits for a free slot like any call.)"""
    body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 960, "temperature": 0,
            "ignore_eos": True, "stream": True}
    expected_refusals = 40 - 32
    burst_decided = threading.Event()
    lock = threading.Lock()
    refused: list[tuple[httpx.Response, dict, float]] = []  # response, its body, seconds it took

    def send(_) -> int:
        sent = time.monotonic()
        with httpx.stream("POST", f"{URL}/v1/completions", json=body, timeout=300) as resp:
            if resp.status_code != 200:
                payload = json.loads(resp.read())
                with lock:
                    refused.append((resp, payload, time.monotonic() - sent))
                    if len(refused) >= expected_refusals:
                        burst_decided.set()
                return resp.status_code
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the response
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
            streaming.release()
            burst_decided.wait(timeout=120)  # then closing the stream aborts the request
            return 200

    streaming = threading.Semaphore(0)  # released by each admitted stream at its first token
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        waves = [pool.map(send, range(16))]
        for _ in range(8):  # the replica's batch full: it has taken (at least) 8 of the 16
            assert streaming.acquire(timeout=120), "the first wave's streams did not start"
        waves.append(pool.map(send, range(24)))
        codes = [code for wave in waves for code in wave]
    served = codes.count(200)
    print(f"\n[backpressure] 16 + 24: {served} served, {len(refused)} refused "
          f"(slowest refusal {max((s for *_, s in refused), default=0):.2f} s)")
    assert served + codes.count(429) == 40, codes
    assert codes[:16] == [200] * 16, codes  # the replica's own 16 are never refused
    # Off by a request or two either way: Serve's router may refuse one more while a queued one
    # is being handed over (its own note), and its cached count of the replica's requests may
    # lag a reply or two, letting a couple through to be turned back and queued again. A bound
    # much looser or tighter than configured fails.
    assert expected_refusals - 2 <= len(refused) <= expected_refusals + 2, codes
    for resp, payload, seconds in refused:
        assert seconds < 30, f"refused after waiting {seconds:.1f} s, not at once"
        assert int(resp.headers["retry-after"]) > 0
        assert payload["error"]["type"] == "RateLimitError", payload
    wait_until(lambda: _status(client)["running"] == 0, "the engine stopping the closed streams' requests",
               timeout_s=120)


# ----------------------------------------------------------------------------------- control plane
def test_controller_lists_the_native_replica(client):
    replica = _status(client)
    assert replica["info"]["capabilities"]["engine"] == "native" and replica["info"]["capabilities"]["supports_trees"]
    wait_until(lambda: any(r["replica_id"] == replica["replica_id"]
                           for r in client.get("/admin/controller").json()["replicas"]),
               f"the controller listing replica {replica['replica_id']}", timeout_s=60)


def test_tree_policy_applied_over_http_and_the_cli_and_steps_count_tree_acceptance(client):
    set_controller(client, "pause")  # a manual policy; the controller would override it
    try:
        resp = client.post("/admin/policy", json={"table": TREE_TABLE})
        assert resp.status_code == 200, resp.text
        (ack,) = resp.json()
        assert ack["status"] == "applied", ack
        replica = _status(client)
        assert str(SpecPolicy.model_validate(replica["policy"])) == TREE_TABLE
        since = time.time()
        for _ in range(2):
            out = client.post("/v1/completions", json={"model": MODEL, "prompt": REPETITIVE, "max_tokens": 24,
                                                       "temperature": 0}).json()
            assert out["usage"]["completion_tokens"] > 0
        steps = [s for s in _status(client)["steps"] if s["time"] > since and s["config"] == "tree4x2x2"]
        assert steps, "no step ran the tree config"
        reached = sum(sum(row) for s in steps for row in s["reached_per_depth_rank"])
        accepted = sum(sum(row) for s in steps for row in s["accepted_per_depth_rank"])
        assert reached > 0 and accepted > 0, (reached, accepted)
        assert all(len(s["reached_per_depth_rank"]) == 3 for s in steps if s["num_decode_reqs"])

        # The trees the controller prices come from the acceptance per (depth, rank) it has
        # measured (the dynamic program), not from the fixed list of its cold start.
        fixed = {str(SpecConfig.tree(w)) for w in TREE_SHAPES if len(w) <= 4}

        def priced_trees() -> set[str]:
            view = client.get("/admin/controller").json()
            mine = [r for r in view["replicas"] if r["replica_id"] == replica["replica_id"]]
            return {c for c in mine[0]["expected_length"] if c.startswith("tree")} if mine else set()

        wait_until(lambda: priced_trees() and priced_trees() != fixed, "the controller pricing trees built from "
                   "measured acceptance", timeout_s=30)

        # The CLI against the native app (its generic checks: tests/test_live_policy.py::
        # test_cli_policy_set_and_status): `policy set` applies a tree table, `status` names the
        # native engine and shows the table.
        cli = str(Path(sys.executable).parent / "adaspec")
        env = {**os.environ, "ADASPEC_URL": URL}
        res = subprocess.run([cli, "policy", "set", "--table", TREE_TABLE], env=env, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0 and "applied" in res.stdout, res.stdout + res.stderr
        res = subprocess.run([cli, "status"], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert "native" in res.stdout and TREE_TABLE in res.stdout, res.stdout
    finally:
        set_controller(client, "resume")


def test_per_request_budgets_served_with_streaming(client, reference_engine):
    """`auto` / `budget8` through the app: applied live, greedy output (streamed and not)
    equal to the model's own greedy decoding, and every step's nodes and accepted tokens
    reported per sequence."""
    set_controller(client, "pause")
    try:
        (ack,) = client.post("/admin/policy", json={"table": "1-2:auto,3+:budget8"}).json()
        assert ack["status"] == "applied", ack
        since = time.time()
        ids = reference_engine.generate([REPETITIVE], SamplingParams(max_tokens=32))[0]
        expected = reference_engine.tokenizer.decode(ids, skip_special_tokens=True)
        body = {"model": MODEL, "prompt": REPETITIVE, "max_tokens": 32, "temperature": 0}
        out = client.post("/v1/completions", json=body).json()
        assert out["choices"][0]["text"] == expected
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            chunks = [json.loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(chunks) == expected and len(chunks) > 1
        steps = [s for s in _status(client)["steps"] if s["time"] > since and s["config"] == "auto"]
        assert steps, "no step ran under auto"
        decode = [s for s in steps if s["num_decode_reqs"]]
        assert all(len(s["nodes_per_seq"]) == s["num_decode_reqs"] and s["node_budget"] == sum(s["nodes_per_seq"])
                   for s in decode)
        assert sum(sum(s["accepted_per_seq"]) for s in decode) > 0, "no draft accepted: verification not exercised"
    finally:
        set_controller(client, "resume")


def test_impossible_tree_is_rejected_with_the_reason(client):
    set_controller(client, "pause")
    try:
        before = _status(client)["policy"]
        (ack,) = client.post("/admin/policy", json={"table": "1+:tree8x8x8"}).json()
        assert ack["status"] == "rejected" and "max_tree_nodes" in ack["message"], ack
        (ack,) = client.post("/admin/policy", json={"table": "1+:tree2x2x2x2x2"}).json()  # deeper than max_k 4
        assert ack["status"] == "rejected" and ack["message"], ack
        assert _status(client)["policy"] == before
    finally:
        set_controller(client, "resume")
