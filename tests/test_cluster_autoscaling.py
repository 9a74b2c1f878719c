"""Ray Serve's own autoscaler on adaspec replicas, through the real stack: the app of
`configs/app-cluster.yaml` with `autoscaling: {min_replicas: 1, max_replicas: 3}` instead of
two fixed replicas, on conftest's two-node loopback cluster and a third node. Load makes
Serve add replicas; the controller's first decision for each is warm (its deployment's
pooled acceptance). With three replicas running, a restarted controller resumes every one
of them from its checkpoint."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import yaml

from bench.loopback_cluster import NodeSpec
from serve_app import admin_client
from tests.conftest import MODEL, ClosedLoopClients, wait_until
from tests.serve_process import REPO, ServeProcess

pytestmark = pytest.mark.slow

URL = "http://127.0.0.1:8003"  # configs/app-cluster.yaml's http_options


@pytest.fixture(scope="module")
def autoscaling_app(cluster, tmp_path_factory) -> ServeProcess:
    workdir = tmp_path_factory.mktemp("autoscaling-app")
    doc = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())
    args = doc["applications"][0]["args"]
    del args["num_replicas"]
    # Two requests per replica is "busy": 6 clients make Serve want 3.
    args["autoscaling"] = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}
    # A third node for the third replica (one logical CPU per node, one replica each).
    cluster.start_node(NodeSpec("worker2", num_cpus=1))
    cluster.wait_for_nodes(3, 120)
    config = workdir / "app-autoscaling.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = ServeProcess(config, URL, workdir / "serve.log", env=cluster.join_env())
    proc.start()
    try:
        proc.wait_ready(MODEL, timeout_s=600)
    except BaseException:
        proc.stop()
        raise
    yield proc
    proc.stop()


class Clients(ClosedLoopClients):
    def _run(self, i: int) -> None:
        body = {"model": MODEL, "prompt": f"List the numbers from {i} to {i + 100}:", "max_tokens": 64,
                "temperature": 0}
        with httpx.Client(base_url=URL, timeout=300) as client:
            while not self.stop.is_set():
                client.post("/v1/completions", json=body)


def test_serve_scales_up_under_load_and_the_new_replicas_start_warm(autoscaling_app):
    first = {r.replica_id for r in admin_client.status(URL)}
    assert len(first) == 1, first
    with Clients(6):
        start = time.time()
        wait_until(lambda: len(admin_client.status(URL)) == 2, "Serve's autoscaler adding a replica", 300)
        second_s = time.time() - start
        wait_until(lambda: len(admin_client.status(URL)) == 3, "Serve's autoscaler adding a third replica", 300)
        third_s = time.time() - start

        def decided_for_all():
            view = admin_client.controller_view(URL)
            decided = {r.replica_id: r for r in view.replicas if r.chosen_policy is not None}
            return decided if len(decided) == 3 else None

        decided = wait_until(decided_for_all, "the controller deciding a policy for the new replicas", 60)
    new = [r for rid, r in decided.items() if rid not in first]
    print(f"\n[autoscaling] second replica {second_s:.0f} s and third {third_s:.0f} s after the load began; "
          + "; ".join(f"{r.replica_id} decided {r.seconds_to_first_decision:.1f} s after its engine was ready, "
                      f"warm: {r.started_warm}" for r in new))
    assert len(new) == 2
    assert all(r.started_warm and r.seconds_to_first_decision <= 2.0 for r in new), new


def test_restarted_controller_resumes_all_three_replicas_from_its_checkpoint(cluster, autoscaling_app):
    """SIGKILL the controller actor's process (a crash; Ray restarts the actor, on the head)
    while three replicas run: it resumes from its checkpoint with every one of them, their
    nodes included, and keeps deciding. (Serve keeps the three a while after the load: its
    downscale delay.) No Ray driver in this process: each extra Ray session in one pytest
    process adds to the teardown crashes of Ray's core worker (ray-project/ray#31145)."""
    live = {r.replica_id: r.info.node_id for r in admin_client.status(URL)}
    assert len(live) == 3 and len(set(live.values())) == 3, live
    wait_until(lambda: {r.replica_id for r in admin_client.controller_view(URL).replicas} == live.keys(),
               "the controller knowing every replica", 60)
    before = admin_client.controller_action(URL, "resume")  # writes a checkpoint (it is not paused)
    (actor,) = [p for p in cluster.processes("head") if "ControllerActor" in " ".join(p.cmdline())]
    killed_at = time.time()
    actor.send_signal(signal.SIGKILL)

    def resumed():
        try:
            view = admin_client.controller_view(URL)
        except admin_client.AdminError:  # the actor restarting
            return None
        # Heard from since the kill: the checkpoint's own last-report times do not count.
        fresh = {r.replica_id for r in view.replicas if r.seconds_since_report < time.time() - killed_at}
        return view if view.restored_from_checkpoint and fresh == live.keys() else None

    after = wait_until(resumed, "the restarted controller, resumed from its checkpoint, hearing from every replica", 120)
    print(f"\n[autoscaling] controller restarted and heard from all 3 replicas {time.time() - killed_at:.1f} s after "
          f"the kill; decisions {before.decisions} -> {after.decisions}")
    assert {r.replica_id: r.node_id for r in after.replicas} == live
    assert after.decisions >= before.decisions
    assert after.deployment(MODEL).step_time_model.samples >= before.deployment(MODEL).step_time_model.samples
