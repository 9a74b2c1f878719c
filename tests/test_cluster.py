"""adaspec as a cluster, through the real stack: a two-node Ray cluster started with
`ray start` on loopback (bench.loopback_cluster), `serve run configs/app-cluster.yaml`
against it (two native-engine replicas, one controller), real HTTP.

One cluster and one app serve every test here (module fixture): starting them takes
about a minute and a half on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from bench.loopback_cluster import LoopbackCluster, NodeSpec
from serve_app import admin_client
from tests.conftest import MODEL, _port_in_use, wait_until
from tests.serve_process import REPO, ServeProcess

pytestmark = pytest.mark.slow

URL = "http://127.0.0.1:8002"  # configs/app-cluster.yaml's http_options
GCS_PORT = 6390


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> LoopbackCluster:
    workdir = tmp_path_factory.mktemp("cluster")
    # One logical CPU per node, one replica bundle each: the two replicas must take two nodes.
    nodes = [NodeSpec("head", num_cpus=1), NodeSpec("worker1", num_cpus=1)]
    cluster = LoopbackCluster(nodes, GCS_PORT, workdir / "logs",
                              env={"ADASPEC_CONTROLLER_DIR": str(workdir / "controller")})
    if _port_in_use(GCS_PORT) or _port_in_use(8002):
        pytest.fail(f"port {GCS_PORT} or 8002 is in use; stop the other cluster first")
    cluster.start()
    yield cluster
    left = cluster.stop()
    assert not left, f"processes of the loopback cluster left behind: {left}"


@pytest.fixture(scope="module")
def app(cluster: LoopbackCluster, tmp_path_factory) -> ServeProcess:
    log = tmp_path_factory.mktemp("cluster-app") / "serve.log"
    proc = ServeProcess(REPO / "configs" / "app-cluster.yaml", URL, log, env=cluster.join_env())
    proc.start()
    try:
        ready_s = proc.wait_ready(MODEL, timeout_s=600)
        # The first completion proves one replica; wait for both before any test.
        wait_until(lambda: len(admin_client.status(URL)) == 2, "two replicas answering /admin/status", 300)
    except BaseException:
        proc.stop()
        raise
    print(f"\n[cluster] app ready {ready_s:.0f} s after `serve run` (log: {log})")
    yield proc
    proc.stop()


def _complete(prompt: str, max_tokens: int = 24) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{URL}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def test_two_replicas_on_two_nodes_serve_and_get_policies(cluster: LoopbackCluster, app: ServeProcess):
    reports = admin_client.status(URL)
    nodes = {r.replica_id: r.info.node_id for r in reports}
    assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes

    prompts = [f"Count from {i} to {i + 20}: {i}, {i + 1}, {i + 2}," for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(_complete, prompts))
    assert all(texts)

    # Both replicas ran engine steps for these requests (the router spread them), ...
    steps = {r.replica_id: len(r.steps) for r in admin_client.status(URL)}
    assert all(n > 0 for n in steps.values()), steps

    # ... both report to the one controller, which knows where each runs ...
    def both_reported():
        view = admin_client.controller_view(URL)
        fresh = {r.replica_id: r for r in view.replicas if r.seconds_since_report < 5}
        return view if fresh.keys() == nodes.keys() else None

    view = wait_until(both_reported, "the controller hearing from both replicas", 60)
    assert {r.replica_id: r.node_id for r in view.replicas} == nodes
    deployment = view.deployment(MODEL)
    assert deployment.replicas == 2 and deployment.nodes == 2

    # ... and has decided a policy for each (the controller explores k under load, so it
    # pushes one to each replica that runs steps).
    assert all(r.chosen_policy is not None for r in view.replicas), [r.chosen_policy for r in view.replicas]
    print("\n" + admin_client.format_controller(view))
