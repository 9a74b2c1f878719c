"""An app served for a test: `serve run <config>` joined to the loopback cluster, or in a local
Ray cluster of its own beside the default app; each stopped afterwards with everything it
started. And the check every multi-replica app on the cluster passes first."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controller.view import ControllerView
from serve_app import admin_client
from testkit.clients import MODEL, complete_text
from testkit.loopback_cluster import LoopbackCluster
from testkit.serve_process import READY_TIMEOUT_S, REPO, ServeProcess, session_processes
from testkit.waits import wait_until


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def app_on_cluster(cluster: LoopbackCluster, config: Path, url: str, workdir: Path, label: str,
                   replicas: int | None = None, timeout_s: float = READY_TIMEOUT_S) -> Iterator[ServeProcess]:
    """`serve run <config>` joined to the loopback `cluster`: ready when a completion succeeds
    (`proc.ready_s`) and, given `replicas`, when that many replicas answer /admin/status
    (`proc.all_ready_s`); stopped afterwards, and every vLLM engine process the app started on
    the cluster's nodes must end with it."""
    log = workdir / "serve.log"
    # Every replica's log line in the log, under its own replica id: Ray's driver would merge
    # lines that differ only in words with digits, ids included, printed within seconds.
    proc = ServeProcess(config, url, log, env={**cluster.join_env(), "RAY_DEDUP_LOGS": "0"})
    start = time.monotonic()
    proc.start()
    try:
        proc.ready_s = proc.wait_ready(MODEL, timeout_s=timeout_s)
        if replicas is not None:
            # The first completion proves one replica; wait for every one before any test.
            wait_until(lambda: len(admin_client.status(url)) == replicas, f"{replicas} replicas answering "
                       f"/admin/status", 180)
        proc.all_ready_s = time.monotonic() - start
    except BaseException:
        proc.stop()
        raise
    print(f"\n[{label}] app ready {proc.ready_s:.0f} s after `serve run`"
          + (f", {replicas} replicas {proc.all_ready_s:.0f} s" if replicas is not None else "") + f" (log: {log})")
    yield proc
    proc.stop()

    def engines() -> list[str]:
        return [f"{p.pid} {p.name()}" for node in list(cluster.sessions) for p in cluster.processes(node)
                if "VLLM" in p.name()]

    # Serve's shutdown ends each replica, and the replica its engine; the cluster kills the rest.
    wait_until(lambda: not engines(), "the app's vLLM engine processes ending with the app", 60, interval_s=1)


@contextlib.contextmanager
def app_in_own_cluster(config: str, port: int, workdir: Path, label: str, model: str = MODEL,
                       env: dict[str, str] | None = None, api_key: str | None = None) -> Iterator[ServeProcess]:
    """`serve run configs/<config>` (or a config file's path) in a local Ray cluster of its own
    (RAY_ADDRESS=local), so it can run beside the default app, with a fresh controller
    checkpoint; stopped afterwards with every process it started. `env`: more environment of
    `serve run` (its Ray cluster's processes inherit it); `api_key`: the OpenAI routes' key."""
    if port_in_use(port):
        pytest.fail(f"port {port} is in use; stop the other server first")
    log = workdir / "serve.log"
    proc = ServeProcess(REPO / "configs" / config, f"http://127.0.0.1:{port}", log,
                        env={"RAY_ADDRESS": "local", "ADASPEC_CONTROLLER_DIR": str(workdir / "controller"),
                             **(env or {})}, api_key=api_key)
    ready_s = proc.start_ready(model)
    print(f"\n[{label}] ready {ready_s:.0f} s after `serve run` (log: {log})")
    yield proc
    proc.stop()
    left = session_processes(proc.proc.pid)
    assert not left, f"processes of `serve run` left behind: {left}"


RAY_SERVE_LLM_PREFIX = "/ray"  # where both_ways puts Ray Serve LLM's own app


def both_ways(config: Path) -> dict:
    """A Serve config whose one application is in Ray Serve LLM's shape
    (`import_path: serve_app:build_openai_app`), twice: as written (adaspec), and under Ray
    Serve LLM's own builder at RAY_SERVE_LLM_PREFIX with the same args less the `adaspec:` block.
    Embedded model names become their folders in both, the one change Ray's builder needs (it
    passes them to vLLM, which knows no embedded names)."""
    from prepare.models import resolve_model

    doc = yaml.safe_load(config.read_text())
    (app,) = doc["applications"]
    for llm in app["args"]["llm_configs"]:
        loading = llm["model_loading_config"]
        loading["model_source"] = resolve_model(loading["model_source"])
        spec = llm.get("engine_kwargs", {}).get("speculative_config") or {}
        if spec.get("model"):
            spec["model"] = resolve_model(spec["model"])
    ray_args = {key: value for key, value in copy.deepcopy(app["args"]).items() if key != "adaspec"}
    ray_app = {**app, "name": "ray-serve-llm", "route_prefix": RAY_SERVE_LLM_PREFIX,
               "import_path": "ray.serve.llm:build_openai_app", "args": ray_args}
    doc["applications"] = [app, ray_app]
    return doc


def eager_engines(doc: dict) -> dict:
    """A Serve config (`doc`, changed in place and returned) whose vLLM engines all run eager
    (`engine_kwargs.enforce_eager`), in adaspec's schema or Ray Serve LLM's. For the modules
    whose checks do not depend on step speed: a cold CPU compile adds one to three minutes per
    app to the suite. The default app (tests/conftest.py) stays compiled, as shipped."""
    for app in doc["applications"]:
        args = app["args"]
        for engine_args in [llm.setdefault("engine_kwargs", {}) for llm in args.get("llm_configs", [])] or \
                [args.setdefault("engine_kwargs", {})]:
            engine_args["enforce_eager"] = True
    return doc


def check_replicas_on_own_nodes_serve_and_get_policies(url: str, replicas: int = 2) -> ControllerView:
    """The app at `url` runs `replicas` replicas, each on a Ray node of its own; all serve real
    completions (each ran engine steps), all report to the one controller, which knows each
    replica's node and has decided a policy for each, and whose deployment view counts them
    on as many nodes. Returns the controller's view."""
    reports = admin_client.status(url)
    nodes = {r.replica_id: r.info.node_id for r in reports}
    assert len(nodes) == replicas and len(set(nodes.values())) == replicas, nodes

    prompts = [f"Count from {i} to {i + 20}: {i}, {i + 1}, {i + 2}," for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: complete_text(url, p), prompts))
    assert all(texts)

    # Every replica ran engine steps for these requests (the router spread them), ...
    steps = {r.replica_id: len(r.steps) for r in admin_client.status(url)}
    assert steps.keys() == nodes.keys() and all(n > 0 for n in steps.values()), steps

    # ... every one reports to the one controller, which knows where each runs ...
    def all_reported():
        view = admin_client.controller_view(url)
        fresh = {r.replica_id: r for r in view.replicas if r.seconds_since_report < 5}
        return view if fresh.keys() == nodes.keys() else None

    view = wait_until(all_reported, f"the controller hearing from all {replicas} replicas", 60)
    assert {r.replica_id: r.node_id for r in view.replicas} == nodes
    deployment = view.deployment(MODEL)
    assert deployment.replicas == replicas and deployment.nodes == replicas

    # ... and has decided a policy for each (the controller explores k under load, so it
    # pushes one to each replica that runs steps).
    assert all(r.chosen_policy is not None for r in view.replicas), [r.chosen_policy for r in view.replicas]
    return view
