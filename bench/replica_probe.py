"""What the replicas measured during a benchmark run, read from adaspec's /admin/status.

The replicas keep a 120 s window of engine steps; the probe polls it every few seconds
while the load runs, keeps each step once, and summarizes the run's steps: acceptance
(telemetry.py's terms: accepted length counts the bonus token) and the speculation in force
over time. Against a server without the admin routes (plain vLLM) the trace says
`available: false`.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from pydantic import BaseModel, Field

from serve_app import admin_client
from adaspec.policy import SpecConfig
from adaspec.telemetry import StepRecord, summarize_acceptance


class TimePoint(BaseModel):
    """One bin of the run (default 1 s) over every replica's steps."""

    t: float = Field(description="seconds since the run started (bin start)")
    steps: int
    mean_batch: float = Field(description="mean requests per step")
    mean_k: float = Field(description="mean draft tokens per sequence the policy asked for")


class PolicyChange(BaseModel):
    t: float = Field(description="seconds since the run started: the first step under the new version")
    replica_id: str
    version: int
    config: SpecConfig = Field(description="the config that step ran with")


class TelemetryTrace(BaseModel):
    available: bool
    steps: int = 0
    mean_accepted_length: float | None = Field(default=None, description="tokens per verify step, bonus included")
    acceptance_rate: float | None = Field(default=None, description="accepted / drafted tokens")
    mean_k: float | None = None
    timeline: list[TimePoint] = Field(default_factory=list)
    policy_changes: list[PolicyChange] = Field(default_factory=list)
    policies_seen: list[str] = Field(default_factory=list, description="policy tables in force, in order")
    error: str = ""


def trace_of(steps: dict[str, list[StepRecord]], start_unix: float, policies: list[str],
             bin_s: float = 1.0) -> TelemetryTrace:
    """Summarize the steps (per replica, any order) that ended after `start_unix`."""
    all_steps = sorted((s for ss in steps.values() for s in ss), key=lambda s: s.time)
    if not all_steps:
        return TelemetryTrace(available=True, policies_seen=policies)
    acc = summarize_acceptance(all_steps)
    bins: dict[int, list[StepRecord]] = defaultdict(list)
    for s in all_steps:
        bins[int((s.time - start_unix) // bin_s)].append(s)
    timeline = [TimePoint(t=i * bin_s, steps=len(b), mean_batch=sum(s.batch_size for s in b) / len(b),
                          mean_k=sum(s.config.depth for s in b) / len(b)) for i, b in sorted(bins.items())]
    changes = []
    for rid, ss in steps.items():
        prev = None
        for s in sorted(ss, key=lambda s: s.time):
            if s.policy_version != prev:
                if prev is not None:
                    changes.append(PolicyChange(t=s.time - s.duration_s - start_unix, replica_id=rid,
                                                version=s.policy_version, config=s.config))
                prev = s.policy_version
    drafted = sum(acc.drafted_per_pos)
    return TelemetryTrace(
        available=True, steps=len(all_steps),
        mean_accepted_length=acc.mean_accepted_length if acc.num_drafts else None,
        acceptance_rate=acc.acceptance_rate if drafted else None,
        mean_k=sum(s.config.depth for s in all_steps) / len(all_steps),
        timeline=timeline, policy_changes=sorted(changes, key=lambda c: c.t), policies_seen=policies)


class ReplicaProbe:
    """Polls /admin/status while a run goes on: `async with ReplicaProbe(url) as p: ...; p.trace()`."""

    def __init__(self, url: str, token: str | None = None, period_s: float = 5.0):
        self.url, self.token, self.period_s = url, token, period_s
        self.steps: dict[str, dict[float, StepRecord]] = defaultdict(dict)  # replica -> step end time -> step
        self.policies: list[str] = []
        self.error = ""
        self.start_unix = time.time()
        self._task: asyncio.Task | None = None

    async def _poll_once(self) -> None:
        try:
            reports = await asyncio.to_thread(admin_client.status, self.url, self.token)
        except admin_client.AdminError as e:
            self.error = str(e)
            return
        for r in reports:
            for s in r.steps:
                if s.time > self.start_unix:
                    self.steps[r.replica_id][s.time] = s
            table = str(r.policy)
            if not self.policies or self.policies[-1] != table:
                self.policies.append(table)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self._poll_once()

    async def __aenter__(self) -> ReplicaProbe:
        self.start_unix = time.time()
        await self._poll_once()
        if self.error:  # no admin routes: a plain vLLM server, or admin disabled
            return self
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            # Steps are recorded at their end; wait a moment for the last ones to land.
            await asyncio.sleep(0.5)
            await self._poll_once()

    def trace(self, bin_s: float = 1.0) -> TelemetryTrace:
        if self.error and not self.steps:
            return TelemetryTrace(available=False, error=self.error)
        return trace_of({rid: list(ss.values()) for rid, ss in self.steps.items()}, self.start_unix,
                        self.policies, bin_s)
