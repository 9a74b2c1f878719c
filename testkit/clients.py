"""Requests and admin calls against a served app, as the real-stack tests send them:
greedy completions, policy pushes, replica status, the controller switch, and a load of
closed-loop clients."""

from __future__ import annotations

import threading

import httpx

from adaspec.policy import SpecPolicy

MODEL = "smollm2-135m-instruct"
URL = "http://127.0.0.1:8000"  # configs/app.yaml's http_options


def complete(client: httpx.Client, prompt: str, max_tokens: int = 32, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete_text(url: str, prompt: str, max_tokens: int = 24) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


def push_policy(client: httpx.Client, table: str, version: int | None = None) -> list[dict]:
    resp = client.post("/admin/policy", json={"table": table, "version": version})
    assert resp.status_code == 200, resp.text
    return resp.json()


def replica_status(client: httpx.Client) -> list[dict]:
    resp = client.get("/admin/status")
    assert resp.status_code == 200, resp.text
    return resp.json()


def replica_steps(client: httpx.Client, version: int | None = None, since: float | None = None) -> list[dict]:
    """The first replica's step records in time order: those run under policy `version`,
    and those that began after `since` (a wall-clock time), where given."""
    steps = replica_status(client)[0]["steps"]
    if version is not None:
        steps = [s for s in steps if s["policy_version"] == version]
    if since is not None:
        steps = [s for s in steps if s["time"] - s["duration_s"] > since]
    return sorted(steps, key=lambda s: s["time"])


def drafted_depth(step: dict) -> int:
    """How many positions a step drafted at (a step record's `drafted_per_pos`)."""
    return sum(1 for n in step["drafted_per_pos"] if n > 0)


def policy_of(status: dict) -> SpecPolicy:
    return SpecPolicy.model_validate(status["policy"])


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
