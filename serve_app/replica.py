"""The replica deployment: Ray Serve LLM's LLMServer hosting a speculative engine.

One replica class for both engines; the engine is LLMServer's `engine_cls`:
- `AdaspecVLLMEngine` (serve_app.vllm_engine, the default): vLLM, chains only;
- `AdaspecNativeEngine` (serve_app.native_adapter): adaspec's native tree engine.
Both answer the OpenAI calls LLMServer forwards and the `SpeculativeEngine` calls below
(the engine contract of adaspec.engine_contract), so everything here (the telemetry window,
arrivals and finishes, the controller loop, the metrics) is shared.

On top of LLMServer it adds the two control-plane methods the architecture names:
- `apply_policy(SpecPolicy) -> PolicyAck`: in force from the engine's next step;
- `telemetry(since) -> ReplicaTelemetry`: steps, acceptance, load, policy in force.
A background task drains the engine's step records every `poll_interval_s` into a bounded
window and exports adaspec's metrics (serve_app.metrics) through Ray's metrics API.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from typing import Any, AsyncGenerator, Protocol

from pydantic import BaseModel, ConfigDict, Field

import ray
from adaspec.engine_contract import EngineReport
from adaspec.policy import PolicyAck, SpecPolicy
from adaspec.telemetry import (
    ROUTING_RECENT_STEPS, ControllerReply, EngineCapabilities, PolicySpeed, ReplicaInfo, ReplicaTelemetry, RequestRecord,
    RoutingStats, StepRecord,
)
from controller.config import ControllerConfig
from ray import serve
from serve_app.metrics import ReplicaMetrics
from serve_app.ray_llm import LLMServer
from serve_app.vllm_engine import AdaspecVLLMEngine

logger = logging.getLogger("ray.serve")


class SpeculativeEngine(Protocol):
    """The control-plane calls a replica makes on its engine (besides LLMEngine's)."""

    async def capabilities(self) -> EngineCapabilities: ...  # asked once, after the engine starts

    async def apply_policy(self, policy: SpecPolicy) -> PolicyAck: ...

    async def drain_report(self) -> EngineReport: ...


class ReplicaSettings(BaseModel):
    """Replica-side settings the app builder passes to every replica."""

    model_config = ConfigDict(extra="forbid")

    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    window_s: float = Field(default=120.0, description="telemetry kept in the replica (seconds)")
    poll_interval_s: float = Field(default=0.25, description="engine drain period (seconds)")


class SpecReplica(LLMServer):
    """An LLMServer whose engine speculates under a live policy and reports every step."""

    _default_engine_cls = AdaspecVLLMEngine

    async def __init__(self, llm_config, *, settings: ReplicaSettings, **kwargs: Any):
        self._settings = settings
        self._steps: deque[StepRecord] = deque()
        self._requests: deque[RequestRecord] = deque()  # finished, as the engine saw them
        self._arrivals: deque[float] = deque()  # unix seconds
        self._finishes: deque[float] = deque()
        self._report: EngineReport | None = None
        self._report_at = 0.0  # unix seconds of the drain that gave _report
        await super().__init__(llm_config, **kwargs)
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except RuntimeError:  # constructed outside Serve (tests)
            self._replica_id = "local"
        context = ray.get_runtime_context()
        self._info = ReplicaInfo(capabilities=await self.engine.capabilities(), node_id=context.get_node_id(),
                                 node_ip=ray.util.get_node_ip_address(), actor_id=context.get_actor_id() or "",
                                 started_at=time.time())
        self._metrics = ReplicaMetrics(llm_config.model_id, self._info.capabilities.max_batch_size)
        await self._poll_engine()
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._poll_forever())
        self._controller = None
        self._speed: PolicySpeed | None = None  # the controller's last prediction (ControllerReply.speed)
        if settings.controller.enabled:
            self._reporter = loop.create_task(self._report_forever())

    # ------------------------------------------------------------------ requests
    async def _tracked(self, stream: AsyncGenerator) -> AsyncGenerator:
        self._arrivals.append(time.time())
        try:
            async for chunk in stream:
                yield chunk
        finally:
            self._finishes.append(time.time())

    async def chat(self, request, raw_request_info=None):
        return self._tracked(await super().chat(request, raw_request_info))

    async def completions(self, request, raw_request_info=None):
        return self._tracked(await super().completions(request, raw_request_info))

    # ------------------------------------------------------------------ control plane
    async def apply_policy(self, policy: SpecPolicy) -> PolicyAck:
        """Install `policy` in the engine; it governs every step after this returns. A policy
        built for another replica (`policy.replica_id`) is not installed."""
        if policy.replica_id is not None and policy.replica_id != self._replica_id:
            assert self._report is not None
            return PolicyAck(replica_id=self._replica_id, status="not_this_replica", message=policy.replica_id,
                             version_in_force=self._report.policy.version, policy_in_force=str(self._report.policy))
        ack = await self.engine.apply_policy(policy)
        ack.replica_id = self._replica_id
        if ack.status == "applied":
            logger.info("adaspec: policy v%d in force: %s", policy.version, policy)
        else:
            logger.warning("adaspec: policy v%d %s: %s", policy.version, ack.status, ack.message)
        await self._poll_engine()
        return ack

    async def telemetry(self, since: float | None = None, with_info: bool = True) -> ReplicaTelemetry:
        """Steps that ended after `since` (unix seconds; default: the whole window);
        `with_info`: include the replica's ReplicaInfo (engine capabilities, node)."""
        await self._poll_engine()
        now = time.time()
        start = max(since, now - self._settings.window_s) if since is not None else now - self._settings.window_s
        steps = [s for s in self._steps if s.time > start]
        window_start = steps[0].time if since is None and steps else start
        assert self._report is not None
        return ReplicaTelemetry(
            replica_id=self._replica_id, model_id=self._llm_config.model_id,
            info=self._info if with_info else None,
            window_start=window_start, window_end=now,
            arrivals=sum(1 for t in self._arrivals if t > window_start),
            finished=sum(1 for t in self._finishes if t > window_start),
            queue_length=self._report.waiting, running=self._report.running,
            policy=self._report.policy, steps=steps,
            requests=[r for r in self._requests if r.finish_time > window_start],
        )

    # ------------------------------------------------------------------ engine polling
    async def _poll_engine(self) -> None:
        drained_at = time.time()
        report = await self.engine.drain_report()
        if report.dropped_steps:
            logger.warning("adaspec: %d step records dropped (poll too slow)", report.dropped_steps)
        self._report, self._report_at = report, drained_at
        self._steps.extend(report.steps)
        self._requests.extend(report.requests)
        horizon = time.time() - self._settings.window_s
        for q, time_of in ((self._steps, lambda s: s.time), (self._requests, lambda r: r.finish_time),
                           (self._arrivals, float), (self._finishes, float)):
            while q and time_of(q[0]) < horizon:
                q.popleft()
        self._metrics.observe(report)

    async def _report_forever(self) -> None:
        """Every control period: telemetry up to the controller, its policy (if any) down.

        If the controller is unreachable the replica keeps its policy and retries next
        period (a restarted controller is found again by name)."""
        from controller.actor import get_or_create_controller

        period = self._settings.controller.period_s
        since, failures, known = time.time(), 0, False
        while True:
            await asyncio.sleep(period)
            try:
                telemetry = await self.telemetry(since=since, with_info=not known)
                since = telemetry.window_end
                if self._controller is None:
                    self._controller = get_or_create_controller(self._settings.controller)
                reply: ControllerReply = await asyncio.wait_for(
                    self._controller.report.remote(telemetry), timeout=5 * period + 5)
                if reply.send_info:  # a controller that lost us (restart, or dropped as silent)
                    telemetry.info = self._info
                    reply = await asyncio.wait_for(self._controller.report.remote(telemetry), timeout=5 * period + 5)
                known, failures = True, 0
                if reply.policy is not None:
                    await self.apply_policy(reply.policy)
                self._speed = reply.speed
            except Exception as e:
                self._controller, known = None, False
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("adaspec: controller unreachable (%d periods): %r; keeping policy v%d",
                                   failures, e, self._report.policy.version if self._report else -1)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.poll_interval_s)
            try:
                await self._poll_engine()
            except Exception:  # keep serving; the next poll retries
                logger.exception("adaspec: telemetry poll failed")

    # ------------------------------------------------------------------ request routing
    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's request-router hook, called by Serve's controller every
        request_routing_stats_period_s: LLMServer's own stats (the engine's KV-event
        endpoints) plus this replica's RoutingStats under its key (serve_app/router.py)."""
        stats = dict(await super().record_routing_stats() or {})
        assert self._report is not None  # the poller's last drain: at most poll_interval_s old
        # When the load was read, not now: the router counts the requests it sent, and saw
        # finish, after this time.
        measured_at = self._report_at
        # Newest records only (the window holds minutes of them); a few times the steps a
        # measure uses, as prefill-only steps do not count.
        steps = list(itertools.islice(reversed(self._steps), 4 * ROUTING_RECENT_STEPS))[::-1]
        requests = list(itertools.islice(reversed(self._requests), ROUTING_RECENT_STEPS))[::-1]
        # The controller's prediction only for the policy it was made for: after a manual
        # policy change the router goes by measurements until the controller's next answer.
        speed = self._speed if self._speed and self._speed.policy_version == self._report.policy.version else None
        ours = RoutingStats.measure(steps, requests, running=self._report.running, waiting=self._report.waiting,
                                    max_batch_size=self._info.capabilities.max_batch_size, measured_at=measured_at,
                                    speed=speed)
        return {**stats, **ours.to_routing_stats()}
