"""Requests and admin calls against a served app, as the real-stack tests send them:
greedy completions, policy pushes, replica status, the controller switch, and a load of
closed-loop clients."""

from __future__ import annotations

import threading
import time

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


def tokens_per_chain_step(steps: list[dict], k: int) -> float:
    """Mean tokens a sequence gained per decode step run at chain k (accepted drafts + 1)."""
    ran = [s for s in steps if s["draft_k"] == k and s["num_decode_reqs"] == 1 and not s["prefill_tokens"]]
    assert len(ran) >= 4, f"only {len(ran)} decode steps at k={k}"
    return sum(1 + sum(s["accepted_per_pos"]) for s in ran) / len(ran)


def acceptance_after_off(client: httpx.Client, prompt: str, k: int = 4, max_tokens: int = 64,
                         off_tokens: int = 24) -> tuple[float, float]:
    """Tokens per chain-k step of one greedy `ignore_eos` completion of `prompt` run at chain k
    throughout, and of the same completion run `off` for its first `off_tokens` streamed chunks
    (a token each under `off`) and at chain k from then on (pushed while it streams). A drafter whose state (a model's
    KV cache) is not kept up while `off` runs drafts badly after the switch. Pushes policies:
    the caller pauses the controller."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    push_policy(client, f"chain{k}")
    since = time.time()
    complete(client, prompt, max_tokens=max_tokens, ignore_eos=True)
    throughout = tokens_per_chain_step(replica_steps(client, since=since), k)
    push_policy(client, "off")
    chunks, switched_at = 0, None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == off_tokens and switched_at is None:
                push_policy(client, f"chain{k}")
                switched_at = time.time()
    assert switched_at is not None, f"the stream ended after {chunks} chunks"
    after_off = tokens_per_chain_step(replica_steps(client, since=switched_at), k)
    return throughout, after_off
