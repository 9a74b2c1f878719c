"""vLLM's Prometheus counters as a served app exports them, and the check that adaspec's own
per-step telemetry counts the same accepted tokens."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from testkit.clients import replica_steps
from testkit.prompts import PROMPTS
from testkit.serve_process import ServeProcess
from testkit.waits import wait_until

T = TypeVar("T")


def counter_sum(metrics: str, name: str) -> float:
    """Sum of a Prometheus counter over all label sets."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def per_pos_counter(metrics: str, name: str) -> dict[int, float]:
    """A counter with a `position` label: position -> sum over the other labels."""
    out: dict[int, float] = {}
    for m in re.finditer(rf'^{name}{{([^}}]*)}} (\S+)$', metrics, re.M):
        pos = re.search(r'position="(\d+)"', m.group(1))
        if pos:
            out[int(pos.group(1))] = out.get(int(pos.group(1)), 0.0) + float(m.group(2))
    return out


def settled(server: ServeProcess, read: Callable[[str], T], what: str, quiet_s: float = 12.0) -> T:
    """`read(metrics text)` once it has not changed for `quiet_s`: longer than Ray's metrics
    export period (10 s by default), so no increment of an earlier test is still on its way."""
    seen = {"value": read(server.metrics_text()), "since": time.monotonic()}

    def quiet() -> tuple[T] | None:  # a tuple: an empty reading (none exported yet) is an answer
        now = read(server.metrics_text())
        if now != seen["value"]:
            seen.update(value=now, since=time.monotonic())
        return (now,) if time.monotonic() - seen["since"] >= quiet_s else None

    return wait_until(quiet, f"{what} still for {quiet_s:.0f} s", interval_s=1.0)[0]


def settled_counter(server: ServeProcess, name: str, quiet_s: float = 12.0) -> dict[int, float]:
    """A per-position counter once it has stopped moving (`settled`)."""
    return settled(server, lambda text: per_pos_counter(text, name), name, quiet_s)


def counter_sums(metrics: str, names: list[str]) -> dict[str, float]:
    """counter_sum of each name."""
    return {name: counter_sum(metrics, name) for name in names}


def check_acceptance_agrees_with_vllm(server: ServeProcess, client: httpx.Client, send: Callable[[str], object]
                                      ) -> None:
    """Send PROMPTS with `send(prompt)` and check that the replica's step records count the
    same accepted tokens per position as vLLM's own counters."""
    name = "ray_vllm_spec_decode_num_accepted_tokens_per_pos_total"
    before = settled_counter(server, name)
    start = time.time()
    for prompt in PROMPTS:
        send(prompt)
    ours: dict[int, int] = {}
    for s in replica_steps(client, since=start):
        for pos, n in enumerate(s["accepted_per_pos"]):
            ours[pos] = ours.get(pos, 0) + n
    assert sum(ours.values()) > 0, "nothing was accepted; the check would be empty"

    def theirs() -> dict[int, int]:
        after = per_pos_counter(server.metrics_text(), name)
        delta = {p: int(after.get(p, 0) - before.get(p, 0)) for p in set(after) | set(ours)}
        return {p: n for p, n in delta.items() if n or p in ours}

    # Ray exports vLLM's counters periodically: wait until they have caught up with ours.
    wait_until(lambda: sum(theirs().values()) >= sum(ours.values()),
               f"vLLM's accepted-token counters reaching adaspec's {sum(ours.values())}")
    assert theirs() == ours, f"vLLM counted {theirs()}, adaspec telemetry {ours}"
