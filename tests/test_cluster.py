"""adaspec as a cluster, through the real stack: a two-node Ray cluster started with
`ray start` on loopback (testkit.loopback_cluster), `serve run configs/app-cluster.yaml`
against it (two native-engine replicas, one controller), real HTTP.

One app serves every test here, on conftest's `cluster` (shared with the other cluster
modules); starting it takes about a minute on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
import ray
import yaml

from adaspec.policy import SpecConfig
from serve_app import admin_client
from testkit.apps import app_on_cluster, check_replicas_on_own_nodes_serve_and_get_policies
from testkit.clients import MODEL, ClosedLoopClients, complete_text
from testkit.loopback_cluster import LoopbackCluster, NodeSpec
from testkit.prometheus import dashboard_queries, prometheus_server, query, targets_up
from testkit.serve_process import REPO, ServeProcess
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

URL = "http://127.0.0.1:8003"  # configs/app-cluster.yaml's http_options
SILENCE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def app(cluster: LoopbackCluster, tmp_path_factory) -> ServeProcess:
    workdir = tmp_path_factory.mktemp("cluster-app")
    # configs/app-cluster.yaml with one change: a 60 s silence timeout, so that a replica
    # dropped within seconds can only have been dropped because Ray reported its actor dead.
    doc = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())
    doc["applications"][0]["args"]["controller"]["replica_timeout_s"] = SILENCE_TIMEOUT_S
    config = workdir / "app-cluster.yaml"
    config.write_text(yaml.safe_dump(doc))
    with app_on_cluster(cluster, config, URL, workdir, "cluster", replicas=2) as proc:
        yield proc


def _complete(prompt: str, max_tokens: int = 24) -> str:
    return complete_text(URL, prompt, max_tokens)


def test_two_replicas_on_two_nodes_serve_and_get_policies(cluster: LoopbackCluster, app: ServeProcess):
    view = check_replicas_on_own_nodes_serve_and_get_policies(URL, replicas=2)
    print("\n" + admin_client.format_controller(view))


class StreamingLoad(ClosedLoopClients):
    """`concurrency` closed-loop clients streaming completions until stopped. Each request
    ends as one of: ok ([DONE] seen), refused (an HTTP error before any token: a request the
    server did not keep), error_event (a clean error event mid-stream), cut (the stream
    ended without [DONE] or an error), hang (no byte for `hang_s`)."""

    OUTCOMES = ("ok", "refused", "error_event", "cut", "hang")

    def __init__(self, concurrency: int, max_tokens: int = 48, hang_s: float = 120.0):
        super().__init__(concurrency)
        self.counts = {o: 0 for o in self.OUTCOMES}
        self.examples: list[str] = []
        self.max_tokens, self.hang_s = max_tokens, hang_s

    def _one(self, client: httpx.Client, i: int) -> tuple[str, str]:
        body = {"model": MODEL, "prompt": f"List the numbers from {i} to {i + 40}:", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0.7}
        got_token = False
        try:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return "refused", f"{resp.status_code} {resp.read()[:200]!r}"
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        return "ok", ""
                    if line.startswith("data: ") and '"error"' in line:
                        return ("error_event" if got_token else "refused"), line[:200]
                    got_token = got_token or line.startswith("data: ")
            return ("cut" if got_token else "refused"), "stream ended without [DONE]"
        except httpx.TimeoutException as e:
            return "hang", repr(e)
        except httpx.HTTPError as e:
            return ("cut" if got_token else "refused"), repr(e)

    def _run(self, i: int) -> None:
        timeout = httpx.Timeout(10.0, read=self.hang_s)
        with httpx.Client(base_url=URL, timeout=timeout) as client:
            n = 0
            while not self.stop.is_set():
                outcome, detail = self._one(client, 100 * i + n)
                n += 1
                self.counts[outcome] += 1
                if outcome != "ok" and len(self.examples) < 5:
                    self.examples.append(f"{outcome}: {detail}")


def test_killed_replica_loses_no_waiting_request_and_its_replacement_starts_warm(app, ray_driver):
    before = {r.replica_id for r in admin_client.status(URL)}
    victim = sorted(before)[0]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(f"#{victim}")]
    with StreamingLoad(concurrency=4) as load:
        wait_until(lambda: load.counts["ok"] >= 4, "4 streamed completions before the kill", 180)
        killed_at = time.time()
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

        def dropped():
            view = admin_client.controller_view(URL)
            return next((d for d in view.dropped if d.replica_id == victim), None)

        gone = wait_until(dropped, f"the controller dropping killed replica {victim}", 30)
        dropped_s = gone.dropped_at - killed_at

        def replacement():
            view = admin_client.controller_view(URL)
            new = [r for r in view.replicas if r.replica_id not in before and r.chosen_policy is not None]
            return new[0] if new else None

        new = wait_until(replacement, "Serve's replacement replica with a policy from the controller", 300)
        ok_then = load.counts["ok"]
        wait_until(lambda: load.counts["ok"] >= ok_then + 4, "4 more completions after the replacement", 180)
    print(f"\n[cluster] replica kill: {load.counts}, dropped by the controller {dropped_s:.1f} s after the kill "
          f"({gone.dropped_at - gone.last_report:.1f} s after its last report; {gone.reason}), "
          f"replacement {new.replica_id} decided for {new.seconds_to_first_decision:.1f} s after its engine was "
          f"ready, warm: {new.started_warm}; {load.examples}")
    # Only requests running on the killed replica may fail, and they must end, not hang.
    assert load.counts["hang"] == 0, load.examples
    assert load.counts["cut"] == 0, load.examples  # a stream cut mid-way ends with an error event
    assert load.counts["refused"] + load.counts["error_event"] <= 4, load.counts
    assert new.started_warm and new.seconds_to_first_decision <= 2.0
    # Its engine took the step-cost calibration the replicas before it cached (same machine,
    # same layout: NativeEngine.load_or_calibrate_step_cost) instead of timing it again.
    loaded = f"{new.replica_id} -- adaspec: per-request budgets' step cost loaded from the cache"
    assert loaded in app.log_path.read_text(errors="replace"), app.log_tail()
    # Ray's word that the actor died, not the silence timeout (60 s here), within about two
    # control periods (1 s) of silence: measured 1.9 s after its last report, 2.6 s after
    # ray.kill was called (Ray takes a while to end the actor).
    assert gone.reason == "its actor died" and gone.dropped_at - gone.last_report <= 3.0 and dropped_s <= 10.0


REPETITIVE = "one two three four five six, one two three four five six, one two three four five six, one two"


def test_router_sends_requests_to_the_replica_that_speculates_well(app):
    """With the controller paused, one replica runs `off` and the other `chain4` on prompts
    whose continuation prompt lookup predicts: the chain4 replica makes more tokens per step,
    so the speculation-aware router predicts it finishes a lone request sooner and sends it
    most of them (power-of-two would split them about evenly)."""
    admin_client.controller_action(URL, "pause")
    try:
        slow, fast = sorted(r.replica_id for r in admin_client.status(URL))
        for replica, table in ((slow, "off"), (fast, "chain4")):
            acks = {a.replica_id: a.status for a in admin_client.set_policy(URL, table, replica_id=replica)}
            assert acks[replica] == "applied", acks
        # Both replicas measure their new policy: concurrent requests spread over both.
        wanted = {slow: SpecConfig.off(), fast: SpecConfig.chain(4)}

        def both_measured():
            # More requests at once than the chain4 replica's batch holds (8): the router is
            # right to send a few requests all to it (it is faster even loaded), so only its
            # queue makes the `off` replica run steps too.
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                list(pool.map(lambda _: _complete(REPETITIVE, 48), range(24)))
            last = {r.replica_id: [str(s.config) for s in r.steps[-16:] if s.num_decode_reqs]
                    for r in admin_client.status(URL)}
            done = all(last[rid].count(str(c)) >= 8 for rid, c in wanted.items())
            return True if done else print(f"decode steps' configs, last 16: {last}")

        wait_until(both_measured, "both replicas running their new policy", 120, interval_s=0)
        since = time.time()
        for _ in range(12):  # one at a time: no load, only speed decides
            _complete(REPETITIVE, 48)
        landed = {rid: sum(1 for q in r.requests if q.finish_time > since)
                  for rid, r in ((r.replica_id, r) for r in admin_client.status(URL))}
    finally:
        admin_client.controller_action(URL, "resume")
    print(f"\n[cluster] lone requests by replica: {landed} (off: {slow}, chain4: {fast})")
    assert sum(landed.values()) == 12, landed
    assert landed[fast] >= 9, landed


def test_every_dashboard_query_answers_from_prometheus_scraping_both_nodes(cluster, app, tmp_path):
    """cluster/grafana/adaspec-dashboard.json against a real Prometheus scraping the two nodes'
    metrics export ports while the app serves: every query of every panel returns series (the
    native replicas' vLLM-named serving and spec-decode series, adaspec's k and policy
    version, the controller's and the router's), and the vLLM-named series carry Serve's tags."""
    targets = cluster.metrics_targets()
    assert len(targets) == 2, targets
    queries = dashboard_queries()
    answered: dict[str, int] = {}
    with prometheus_server(targets, tmp_path) as prom, concurrent.futures.ThreadPoolExecutor(4) as pool:
        wait_until(lambda: list(targets_up(prom).values()) == ["up", "up"], "Prometheus scraping both nodes", 60)

        def all_answered() -> bool | None:
            list(pool.map(lambda i: _complete(f"{REPETITIVE} {i}", 32), range(8)))  # both replicas draft
            for name, expr in queries.items():
                if name not in answered and (series := query(prom, expr)):
                    answered[name] = len(series)
            missing = [name for name in queries if name not in answered]
            return True if not missing else print(f"queries with no series yet: {missing}")

        # Ray's agents export every 10 s; a rate needs two scrapes of a changed value.
        wait_until(all_answered, "every dashboard query answering", 180, interval_s=0)
        tagged = query(prom, 'ray_vllm_spec_decode_num_drafts_total{model_name!="", deployment!="", '
                             'application!="", replica!=""}')
    assert tagged, "vLLM-named spec-decode counters without Serve's tags"
    print(f"\n[cluster] {len(queries)} dashboard queries answered; series per query: {answered}")


def _node_names() -> dict[str, str]:
    """Ray node id -> the name testkit.loopback_cluster gave it (its `node:<name>` resource)."""
    names = {}
    for node in ray.nodes():
        for resource in node["Resources"]:
            if resource.startswith("node:") and not resource.startswith("node:_") and not resource[5].isdigit():
                names[node["NodeID"]] = resource[5:]
    return names


def test_lost_worker_node_loses_only_streams_on_it_and_the_controller_carries_on(cluster, app, ray_driver):
    """Kill every process of the worker node (its raylet and the replica on it) under load;
    a spare node joined beforehand takes the replacement replica."""
    cluster.start_node(NodeSpec("worker2", num_cpus=1))
    cluster.wait_for_nodes(3, 120)
    names = _node_names()
    before = {r.replica_id: names.get(r.info.node_id) for r in admin_client.status(URL)}
    (victim,) = [rid for rid, node in before.items() if node == "worker1"]
    decisions_before = admin_client.controller_view(URL).decisions
    with StreamingLoad(concurrency=4) as load:
        wait_until(lambda: load.counts["ok"] >= 4, "4 streamed completions before the node is lost", 180)
        killed_at = time.time()
        cluster.kill_node("worker1")

        def replaced():
            view = admin_client.controller_view(URL)
            ids = {r.replica_id for r in view.replicas}
            new = [r for r in view.replicas if r.replica_id not in before and r.chosen_policy is not None]
            return (view, new[0]) if victim not in ids and new else None

        view, new = wait_until(replaced, "the dead node's replica dropped and replaced by the controller", 300)
        replaced_s = time.time() - killed_at
        ok_then = load.counts["ok"]
        wait_until(lambda: load.counts["ok"] >= ok_then + 4, "4 more completions after the replacement", 180)
    new_node = _node_names().get(new.node_id)
    print(f"\n[cluster] node loss: {load.counts}, replacement {new.replica_id} on {new_node} with a policy "
          f"{replaced_s:.1f} s after the kill, warm: {new.started_warm}; {load.examples}")
    assert load.counts["hang"] == 0 and load.counts["cut"] == 0, load.examples
    assert load.counts["refused"] + load.counts["error_event"] <= 4, load.counts
    assert new_node == "worker2" and new.started_warm
    assert view.decisions > decisions_before  # the controller, on the head, kept deciding
