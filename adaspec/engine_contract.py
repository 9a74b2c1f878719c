"""The contract between a replica and its speculative engine.

An engine (vLLM's scheduler subclass, the native engine, a third one) owns drafting,
verification and the recording of each step. What every engine does the same way lives
here, once:
- `PolicySlot`: the policy in force. `apply` validates a pushed policy against the
  engine's capabilities, ignores versions older than the one in force, compiles it to a
  dense per-batch-size table (one list lookup per step) and answers a `PolicyAck`. The slot
  also buffers the engine's step and finished-request records until the replica drains
  them into an `EngineReport`.
- `EngineReport`: one drain: the records since the previous one and the load now.
- `EngineCapabilities` (adaspec.telemetry) are fixed when the engine starts; the replica
  asks for them once, not with every drain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from adaspec.policy import PolicyAck, PolicyError, SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, RequestRecord, StepRecord

# Records kept between two drains (the replica drains every 0.25 s; at a few ms a step this
# is minutes of steps). Older ones are dropped and counted.
MAX_BUFFERED_STEPS = 20_000


class EngineReport(BaseModel):
    """One drain of an engine: what happened since the previous drain, and its load now."""

    model_config = ConfigDict(extra="forbid")

    steps: list[StepRecord]
    requests: list[RequestRecord]  # finished since the previous drain
    dropped_steps: int  # step records lost because the buffer was full
    waiting: int  # requests queued
    running: int  # requests in the running batch
    policy: SpecPolicy  # in force


class PolicySlot:
    """An engine's live policy and its telemetry buffer (not thread-safe: the engine's own
    thread, or its event loop, calls every method).

    `check` is the engine's own test of a policy beyond its capabilities (the native engine
    refuses trees bigger than its KV cache leaves room for); it raises PolicyError."""

    def __init__(self, capabilities: EngineCapabilities, policy: SpecPolicy,
                 check: Callable[[SpecPolicy], None] | None = None):
        self.capabilities = capabilities
        self._check = check
        self.validate(policy)
        self.policy = policy
        self.table: list[SpecConfig] = policy.compile(capabilities.max_batch_size)
        self._steps: deque[StepRecord] = deque(maxlen=MAX_BUFFERED_STEPS)
        self._requests: deque[RequestRecord] = deque(maxlen=MAX_BUFFERED_STEPS)
        self._recorded = 0
        self._drained = 0

    # ------------------------------------------------------------------ policy
    def validate(self, policy: SpecPolicy) -> None:
        """Raise PolicyError unless this engine can run every config of `policy`."""
        caps = self.capabilities
        policy.check_engine(caps.max_batch_size, caps.max_k, caps.supports_trees, caps.supports_budgets)
        if self._check is not None:
            self._check(policy)

    def apply(self, policy: SpecPolicy) -> PolicyAck:
        """Install `policy` for every later step; stale versions are ignored, bad ones rejected."""
        try:
            self.validate(policy)
        except PolicyError as e:
            return self._ack("rejected", str(e))
        if policy.version < self.policy.version:
            return self._ack("ignored_stale", f"version {policy.version} < {self.policy.version} in force")
        self.policy, self.table = policy, policy.compile(self.capabilities.max_batch_size)
        return self._ack("applied")

    def reject(self, message: str) -> PolicyAck:
        """The answer to a push that is not a policy at all (the old one stays)."""
        return self._ack("rejected", message)

    def config_for(self, batch_size: int) -> SpecConfig:
        """The config in force at this running batch size (requests)."""
        return self.table[min(batch_size, self.capabilities.max_batch_size)]

    def _ack(self, status: str, message: str = "") -> PolicyAck:
        return PolicyAck(status=status, message=message, version_in_force=self.policy.version,
                         policy_in_force=str(self.policy))

    # ------------------------------------------------------------------ telemetry buffer
    def record_step(self, step: StepRecord) -> None:
        self._steps.append(step)
        self._recorded += 1

    def record_request(self, record: RequestRecord) -> None:
        self._requests.append(record)

    def drain(self, waiting: int, running: int) -> EngineReport:
        """The records since the previous drain (oldest first), with the load now (requests)."""
        steps, requests = list(self._steps), list(self._requests)
        self._steps.clear()
        self._requests.clear()
        dropped = self._recorded - self._drained - len(steps)
        self._drained = self._recorded
        return EngineReport(steps=steps, requests=requests, dropped_steps=max(dropped, 0), waiting=waiting,
                            running=running, policy=self.policy)
