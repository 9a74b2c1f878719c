"""Ray Serve's own autoscaler on adaspec replicas, through the real stack: the app of
`configs/app-cluster.yaml` with `autoscaling: {min_replicas: 1, max_replicas: 2}` instead of
two fixed replicas, on conftest's two-node loopback cluster. Load makes Serve add a replica;
the controller's first decision for it is warm (its deployment's pooled acceptance)."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from serve_app import admin_client
from testkit.clients import MODEL, ClosedLoopClients
from testkit.serve_process import REPO, ServeProcess
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

URL = "http://127.0.0.1:8003"  # configs/app-cluster.yaml's http_options


@pytest.fixture(scope="module")
def autoscaling_app(cluster, tmp_path_factory) -> ServeProcess:
    workdir = tmp_path_factory.mktemp("autoscaling-app")
    doc = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())
    args = doc["applications"][0]["args"]
    del args["num_replicas"]
    # Two requests per replica is "busy": 6 clients make Serve want 3, capped at 2.
    args["autoscaling"] = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2}
    config = workdir / "app-autoscaling.yaml"
    config.write_text(yaml.safe_dump(doc))
    proc = ServeProcess(config, URL, workdir / "serve.log", env=cluster.join_env())
    proc.start_ready(MODEL)
    yield proc
    proc.stop()


class Clients(ClosedLoopClients):
    def _run(self, i: int) -> None:
        body = {"model": MODEL, "prompt": f"List the numbers from {i} to {i + 100}:", "max_tokens": 64,
                "temperature": 0}
        with httpx.Client(base_url=URL, timeout=300) as client:
            while not self.stop.is_set():
                client.post("/v1/completions", json=body)


def test_serve_scales_up_under_load_and_the_new_replica_starts_warm(autoscaling_app):
    first = {r.replica_id for r in admin_client.status(URL)}
    assert len(first) == 1, first
    with Clients(6):
        start = time.time()
        wait_until(lambda: len(admin_client.status(URL)) == 2, "Serve's autoscaler adding a replica", 300)
        scaled_s = time.time() - start

        def decided_for_both():
            view = admin_client.controller_view(URL)
            decided = {r.replica_id: r for r in view.replicas if r.chosen_policy is not None}
            return decided if len(decided) == 2 else None

        decided = wait_until(decided_for_both, "the controller deciding a policy for the new replica", 60)
    (new,) = [r for rid, r in decided.items() if rid not in first]
    print(f"\n[autoscaling] second replica {new.replica_id} {scaled_s:.0f} s after the load began; "
          f"decided {new.seconds_to_first_decision:.1f} s after its engine was ready, warm: {new.started_warm}")
    assert new.started_warm and new.seconds_to_first_decision <= 2.0
