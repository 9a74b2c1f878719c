"""The adaptive controller on the real stack (configs/app.yaml runs it): it changes a live
vLLM replica's speculation from measurements, survives its own crash, and forgets dead
replicas."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
import ray

from serve_app.admin_client import format_controller
from adaspec.policy import SpecConfig
from controller.actor import NAMESPACE, get_controller
from controller.checkpoint_file import CHECKPOINT_FILE
from controller.view import ControllerView
from testkit.clients import MODEL, URL, complete, push_policy, replica_status, set_controller
from testkit import reaction
from testkit.prompts import LOOPING, STORY
from testkit.serve_process import session_processes
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

PROMPT = STORY  # LOOPING: prompt lookup's chain4 takes 4.2 tokens a step on it (PROMPT: 1.4)


def _load(concurrency: int, max_tokens: int = 96, prompt: str = PROMPT) -> reaction.Load:
    return reaction.Load(URL, concurrency, max_tokens, prompt)


@pytest.fixture(scope="module")
def ray_client(server):
    if ray.is_initialized():  # e.g. a local instance an earlier test's Ray call started
        ray.shutdown()
    # `serve run` started a new local cluster, which Ray 2.60 runs with token auth (the token in
    # ~/.ray/auth_token). A driver joining it must use token auth too; it does so by itself only
    # if this process started a local cluster earlier (as the full suite's unit tests do), so a
    # run of the real-stack tests alone would fail here without this.
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    ray.init(address=server.gcs_address(), namespace=NAMESPACE, log_to_driver=False)
    yield
    ray.shutdown()


def test_controller_view_is_served(client):
    set_controller(client, "resume")

    def reported() -> dict | None:
        view = client.get("/admin/controller").json()
        fresh = [r for r in view["replicas"] if r["seconds_since_report"] < 5]
        return view if not view["paused"] and fresh and any(d["model_id"] == MODEL for d in view["deployments"]) else None

    view = wait_until(reported, "the resumed controller listing a replica that reported within 5 s", timeout_s=60)
    (replica,) = view["replicas"]
    assert replica["model_id"] == MODEL


def _phase(client, batch_lo: int, batch_hi: int, settled, what: str) -> tuple[set[str], str]:
    """testkit.reaction.settle, with what the replica ran and what the controller thought
    when it fails: a failure here is a controller finding, and CI keeps only this output."""
    begin = time.time()
    try:
        return reaction.settle(client, batch_lo, batch_hi, settled, what)
    except pytest.fail.Exception as failed:
        steps = reaction.steps_at(client, begin, 1, 10_000)
        ran = Counter((s["batch_size"], s["config"]) for s in steps if s["time"] > time.time() - 30)
        status = {k: v for k, v in replica_status(client)[0].items() if not isinstance(v, list)}
        view = ControllerView.model_validate(client.get("/admin/controller").json())
        pytest.fail(f"{failed}\nsteps of the last 30 s by (batch, config): {sorted(ran.items())}\n"
                    f"replica: {status}\n{format_controller(view)}")


def test_controller_speculates_for_one_stream_and_tries_a_second_config_under_a_burst(client):
    """The controller decides from what it measures on this replica. It is not required to
    lower k under the burst (which config is best there is a close call on this CPU, below).
    - One stream of LOOPING, whose greedy continuation prompt lookup predicts almost every
      time, starting from `off` everywhere: it must move to speculation, which pays on any
      machine there (chain4 3.8-4.1x the tokens/s of `off` on a Zen 4 machine:
      docs/benchmarks.md, "Speculation by load"). (With PROMPT at batch 1
      it is a close call whose answer depends on the machine: the pooled acceptance at the
      first position was 0.17 at the end of one run of this test.)
    - A 24-stream burst of PROMPT: it must try a second config there (its recurring trials:
      chain1 every 30 s while a bucket is off, off every 60 s while it speculates, within 5%
      of the steps; the shipped profile already measured every config there) and settle.
      Which config is best there is a close call on this CPU (chain1, chain2 and off within
      about 10% of each other at 24 streams), so the test names none; test_controller_core
      checks the choice against a known, synthetic truth. The step-time model's prediction
      for the burst is printed, not asserted: with both cores busy it once predicted 0.113 s
      for 0.278 s steps (an open controller issue).
    - One stream again: it speculates again (the burst did not overwrite the batch-1 rule)."""
    set_controller(client, "pause")
    push_policy(client, "off")
    set_controller(client, "resume")
    with _load(1, prompt=LOOPING):
        _, low = _phase(client, 1, 1, lambda seen, last: SpecConfig.parse(last).depth >= 1,
                        "the controller settling on a speculating config for one stream")
    with _load(24):
        tried, busy = _phase(client, 17, 32, lambda seen, last: len(seen) >= 2,
                             "the controller trying a second config at batch 17-32 and settling")
        view = ControllerView.model_validate(client.get("/admin/controller").json())
    with _load(1, prompt=LOOPING):
        _, again = _phase(client, 1, 1, lambda seen, last: SpecConfig.parse(last).depth >= 1,
                          "the controller speculating for one stream again")
    # The phases' conditions are the assertions: each fails the test if it does not come about.
    (replica,) = view.replicas
    print(f"\none stream: {low}; burst: tried {sorted(tried)}, settled on {busy}; one stream again: {again}; "
          f"burst step time measured {replica.measured_step_s:.3f} s, predicted {replica.predicted_step_s:.3f} s")
    # Meanwhile the controller fitted request latency per config from finished requests.
    view = client.get("/admin/controller").json()
    (replica,) = view["replicas"]
    fits = [c for c in replica["latency_fits"] if c["fit"]["samples"] >= 8]
    assert fits, replica["latency_fits"]
    assert replica["measured_latency_s"] > 0
    print("\n" + format_controller(ControllerView.model_validate(view)))


PERIOD_S = 1.0  # configs/app.yaml's controller.period_s


def test_the_controller_leaves_off_for_chain4_far_faster_than_before(client):
    """Issue 51, item 2, the scenario docs/benchmarks.md measured at 65-81 s before shadow
    acceptance: 8 streams of PROMPT under chain4, then one stream of LOOPING from `off`
    (testkit/reaction.py; the controller is resumed once that stream's first decode step is
    seen). The replica's n-gram shadow measures chain4's acceptance while `off` runs and the
    acceptance model sees that the requests changed, so chain4, the best static config there
    (3.8-4.1x `off`), is decided for batch 1 within 30 control periods of that step; before,
    81 s. The goal is 2: `python -m bench.reaction` met it with a fresh controller (0.87-1.16
    periods, 3 rounds), but in this suite, after the burst and crash tests above, it took
    14.9 s in one run and 0.63 periods in another (2026-12-07): the test bounds what holds,
    and fails if the old behaviour returns."""
    periods = reaction.forward(client, URL, target="chain4").periods(PERIOD_S)
    view = ControllerView.model_validate(client.get("/admin/controller").json())
    print(f"\n[reaction] off -> chain4 for the looping stream decided {periods:.2f} periods after its first step; "
          f"workload changes seen {view.replicas[0].workload_changes}")
    assert periods <= 30, periods


def _view_or_none():
    """The controller's view, or None while Ray restarts it."""
    try:
        return ray.get(get_controller().view.remote(), timeout=10)
    except (ValueError, ray.exceptions.RayError):
        return None


def test_controller_crash_loses_no_request_and_resumes_from_checkpoint(server, client, ray_client):
    set_controller(client, "resume")
    checkpoint = Path(server.extra_env["ADASPEC_CONTROLLER_DIR"]) / CHECKPOINT_FILE
    before = ray.get(get_controller().view.remote())
    assert not before.restored_from_checkpoint  # the session started with no checkpoint
    taken = time.time()
    with _load(4) as load:
        # Killed with requests in flight, after a checkpoint newer than `before`.
        wait_until(lambda: load.ok >= 1 and checkpoint.is_file() and checkpoint.stat().st_mtime > taken,
                   "a finished request and a controller checkpoint written after the first view")
        ray.kill(get_controller(), no_restart=False)  # Ray restarts it
        killed_at, ok_at_kill = time.time(), load.ok

        def resumed_and_reported_to():
            view = _view_or_none()
            heard = view and [r for r in view.replicas if time.time() - r.seconds_since_report > killed_at]
            return view if heard and view.restored_from_checkpoint else None

        after = wait_until(resumed_and_reported_to,
                           "the restarted controller, resumed from its checkpoint, hearing from the replica")
        wait_until(lambda: load.ok > ok_at_kill, "a request finishing after the controller was killed")
    assert not load.failures, load.failures[:3]
    assert after.decisions >= before.decisions  # resumed, not reset
    assert after.deployment(MODEL).step_time_model.samples >= before.deployment(MODEL).step_time_model.samples
    assert len(after.replicas) == 1


@pytest.mark.last
def test_killed_engine_fails_in_flight_requests_cleanly_and_serve_replaces_the_replica(server, client):
    """SIGKILL of the vLLM engine-core process under load (4 streams, 4 plain requests):
    plain requests get HTTP 503 with Retry-After, streams end with an error event then
    [DONE], all within seconds; Serve's health check replaces the replica, whose engine then
    serves; the controller drops the old replica and hears from the new one; no process of
    the dead engine is left."""
    set_controller(client, "resume")
    (old,) = replica_status(client)
    engine = [p for p in session_processes(server.proc.pid) if p.name() == "VLLM::EngineCore"]
    assert len(engine) == 1, engine
    dead_engine = [engine[0], *engine[0].children(recursive=True)]  # its worker too
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    first_chunks = threading.Barrier(5)

    def stream(_):
        events = []
        with httpx.stream("POST", f"{URL}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        first_chunks.wait(timeout=120)
        return events, time.monotonic()

    def plain(_):
        resp = httpx.post(f"{URL}/v1/completions", json=body, timeout=120)
        return resp, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, i) for i in range(4)]
        plains = [pool.submit(plain, i) for i in range(4)]
        first_chunks.wait(timeout=120)  # every stream under way
        killed_at = time.monotonic()
        engine[0].send_signal(signal.SIGKILL)
        stream_results = [f.result() for f in streams]
        plain_results = [f.result() for f in plains]
    for events, _ in stream_results:
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    for resp, _ in plain_results:
        assert resp.status_code == 503 and int(resp.headers["retry-after"]) > 0, resp.text
        assert resp.json()["error"]["type"] == "ServiceUnavailableError", resp.text
    ended_s = max(t for _, t in stream_results + plain_results) - killed_at
    assert ended_s < 30, ended_s

    def replaced():
        try:
            reports = replica_status(client)
        except AssertionError:  # 503 while no replica can serve
            return None
        return reports if reports and reports[0]["replica_id"] != old["replica_id"] else None

    (new,) = wait_until(replaced, "Serve replacing the replica whose engine died", 480, interval_s=2)
    served_s = time.monotonic() - killed_at
    assert complete(client, "Hello", max_tokens=4)["choices"][0]["text"] is not None
    view = wait_until(lambda: (v := ControllerView.model_validate(client.get("/admin/controller").json())) and
                      [r.replica_id for r in v.replicas] == [new["replica_id"]] and v,
                      "the controller dropping the old replica and hearing from the new one", 60)
    assert old["replica_id"] in [d.replica_id for d in view.dropped]
    left = [p for p in dead_engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left
    print(f"\n[engine killed] in-flight requests ended {ended_s:.1f} s after the kill (4 x 503, 4 streams with an "
          f"error event); a new replica served {served_s:.0f} s after it; controller dropped "
          f"{old['replica_id']}, hears from {new['replica_id']}")


@pytest.mark.last
def test_dead_replica_is_dropped(client, ray_client):
    set_controller(client, "resume")
    rid = replica_status(client)[0]["replica_id"]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and f"#{rid}" in a["name"]]
    assert rid in [r.replica_id for r in ray.get(get_controller().view.remote()).replicas]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    wait_until(lambda: rid not in [r.replica_id for r in ray.get(get_controller().view.remote()).replicas],
               f"the controller dropping killed replica {rid}", timeout_s=60)
