"""A controller crash with three replicas running, through the real stack: the app of
`configs/app-cluster.yaml` with three fixed replicas, on conftest's two-node loopback cluster
and a third node (one replica per node). The controller actor's process is killed with
SIGKILL; Ray restarts the actor on the head and it resumes every replica from its checkpoint.

No Ray driver in this process: each extra Ray session in one pytest process adds to the
teardown crashes of Ray's core worker (ray-project/ray#31145)."""

from __future__ import annotations

import signal
import time

import pytest
import yaml

from serve_app import admin_client
from testkit.apps import app_on_cluster
from testkit.clients import MODEL
from testkit.loopback_cluster import LoopbackCluster, NodeSpec
from testkit.serve_process import REPO, ServeProcess
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

URL = "http://127.0.0.1:8003"  # configs/app-cluster.yaml's http_options
REPLICAS = 3


@pytest.fixture(scope="module")
def app(cluster: LoopbackCluster, tmp_path_factory) -> ServeProcess:
    workdir = tmp_path_factory.mktemp("restart-app")
    doc = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())
    doc["applications"][0]["args"]["num_replicas"] = REPLICAS
    # A third node for the third replica (one logical CPU per node, one replica each).
    cluster.start_node(NodeSpec("worker2", num_cpus=1))
    cluster.wait_for_nodes(REPLICAS, 120)
    config = workdir / "app-restart.yaml"
    config.write_text(yaml.safe_dump(doc))
    with app_on_cluster(cluster, config, URL, workdir, "restart", replicas=REPLICAS) as proc:
        yield proc


def test_restarted_controller_resumes_all_three_replicas_from_its_checkpoint(cluster, app):
    """SIGKILL the controller actor's process (a crash): Ray restarts the actor on the head,
    it resumes from its checkpoint with every replica, their nodes included, hears from each
    of them after the kill, and keeps its models and decision count."""
    live = {r.replica_id: r.info.node_id for r in admin_client.status(URL)}
    assert len(live) == REPLICAS and len(set(live.values())) == REPLICAS, live
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
    print(f"\n[restart] controller restarted and heard from all {REPLICAS} replicas {time.time() - killed_at:.1f} s "
          f"after the kill; decisions {before.decisions} -> {after.decisions}")
    assert {r.replica_id: r.node_id for r in after.replicas} == live
    assert after.decisions >= before.decisions
    assert after.deployment(MODEL).step_time_model.samples >= before.deployment(MODEL).step_time_model.samples
