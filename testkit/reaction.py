"""The controller's reaction to a change of workload, on a served default app (issue 51, item 2):
the scenario tests/test_controller_live.py asserts (forward, to chain4) and `python -m
bench.reaction` repeats.

- forward: 8 streams of STORY (prompt lookup drafts it badly) run under chain4 with the
  controller paused, then one stream of LOOPING under `off`; the controller is resumed as
  soon as that stream's first decode step is seen (the time the caller takes to see it counts
  against the controller).
- reverse: from that one stream, 8 streams of STORY with the controller running.
Reaction: from the new workload's first decode step to the decision of the config the
controller runs for it once settled (80% of 10 s of steps at its batch sizes; a policy's
version is the wall-clock ms it was decided); 0 when that config was in force already.

The 65-81 s measured before shadow acceptance (docs/benchmarks.md) is the forward case.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx

from testkit.clients import MODEL, ClosedLoopClients, push_policy, replica_status, set_controller
from testkit.prompts import LOOPING, STORY
from testkit.waits import wait_until

STREAMS = 8  # the busy side of the scenario


class Load(ClosedLoopClients):
    """`concurrency` closed-loop clients sending greedy `ignore_eos` completions of `prompt`
    to `url` until stopped; counts successes and failures."""

    def __init__(self, url: str, concurrency: int, max_tokens: int = 96, prompt: str = STORY):
        super().__init__(concurrency)
        self.ok = 0
        self.failures: list[str] = []
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while not self.stop.is_set():
                try:
                    r = c.post("/v1/completions", json={"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens,
                                                        "temperature": 0, "ignore_eos": True})
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))


def steps_at(client: httpx.Client, since: float, batch_lo: int, batch_hi: int) -> list[dict]:
    """Decode steps (no prefill) of the first replica that ended after `since` at these batch sizes."""
    return [s for s in replica_status(client)[0]["steps"]
            if s["time"] > since and batch_lo <= s["batch_size"] <= batch_hi and not s["prefill_tokens"]]


def settle(client: httpx.Client, batch_lo: int, batch_hi: int, settled, what: str,
           timeout_s: float = 180.0) -> tuple[set[str], str]:
    """Wait until `settled(configs seen, config of the last 10 s)` holds for the steps at these
    batch sizes since the call; returns both. One config must have run 80% of the last 10 s of
    steps: the controller has chosen and is not trying a neighbour."""
    begin = time.time()

    def probe():
        steps = steps_at(client, begin, batch_lo, batch_hi)
        recent = Counter(s["config"] for s in steps if s["time"] > time.time() - 10)
        if time.time() - begin < 10 or not recent:
            return None
        last, n = recent.most_common(1)[0]
        seen = {s["config"] for s in steps}
        if n >= 0.8 * recent.total() and settled(seen, last):
            return seen, last
        return None

    return wait_until(probe, what, timeout_s=timeout_s, interval_s=2)


def first_step(client: httpx.Client, since: float, batch_lo: int, batch_hi: int, what: str,
               matches=lambda s: True) -> dict:
    """The first decode step at these batch sizes that ended after `since` and `matches`."""
    def probe():
        steps = [s for s in steps_at(client, since, batch_lo, batch_hi) if matches(s)]
        return min(steps, key=lambda s: s["time"]) if steps else None
    return wait_until(probe, what, timeout_s=120, interval_s=0.1)


@dataclass(frozen=True)
class Reaction:
    direction: str  # "forward" (8 streams of STORY -> LOOPING) or "reverse"
    before: str  # the config in force at the new workload's first decode step
    after: str  # the config the controller chose for it
    seconds: float  # from that step to the decision of `after`

    def periods(self, period_s: float) -> float:
        return self.seconds / period_s

    def as_dict(self) -> dict:
        return asdict(self)


def _settled_reaction(client: httpx.Client, direction: str, first: dict, batch_lo: int, batch_hi: int) -> Reaction:
    """From the new workload's `first` decode step: the config the controller settles on at
    these batch sizes and when it was decided (0 s when it was in force already)."""
    _, settled = settle(client, batch_lo, batch_hi, lambda seen, last: True,
                        f"the controller settling at batch {batch_lo}-{batch_hi}")
    # From `first` on (included): not a step of the old workload's last requests at these sizes.
    reached = first_step(client, first["time"] - 1e-3, batch_lo, batch_hi,
                         f"a {settled} step at batch {batch_lo}-{batch_hi}", lambda s: s["config"] == settled)
    return Reaction(direction, first["config"], settled, max(reached["policy_version"] / 1000 - first["time"], 0.0))


def forward(client: httpx.Client, url: str, target: str | None = None) -> Reaction:
    """8 streams of STORY under chain4, then one stream of LOOPING from `off`. With `target`,
    the reaction ends at the decision of the first policy that runs `target` at batch 1
    instead of the one the controller settles on."""
    set_controller(client, "pause")
    push_policy(client, "chain4")
    with Load(url, STREAMS):
        settle(client, 5, STREAMS, lambda seen, last: last == "chain4", f"{STREAMS} streams of STORY under chain4")
    push_policy(client, "off")
    pushed_at = time.time()
    with Load(url, 1, prompt=LOOPING):
        first = first_step(client, pushed_at, 1, 1, "the looping stream's first decode step under off",
                           lambda s: s["config"] == "off")
        set_controller(client, "resume")
        if target is None:
            return _settled_reaction(client, "forward", first, 1, 1)
        reached = first_step(client, first["time"] - 1e-3, 1, 1, f"a {target} step at batch 1",
                             lambda s: s["config"] == target)
        return Reaction("forward", first["config"], target, reached["policy_version"] / 1000 - first["time"])


def reverse(client: httpx.Client, url: str) -> Reaction:
    """From one stream of LOOPING (the controller running), 8 streams of STORY."""
    set_controller(client, "resume")
    changed_at = time.time()
    with Load(url, STREAMS):
        first = first_step(client, changed_at, 5, STREAMS, f"the first decode step of {STREAMS} streams")
        return _settled_reaction(client, "reverse", first, 5, STREAMS)
