"""A stand-in engine for the controller's unit tests (no Ray, no vLLM): `synthetic_step_time`,
a step's cost with the roofline's knee, and `SimulatedReplica`, a replica stepping a fixed
batch under the policy the controller gives it, with i.i.d. acceptance."""

from __future__ import annotations

import numpy as np

from adaspec.policy import SpecPolicy
from adaspec.telemetry import EngineCapabilities, ReplicaInfo, ReplicaTelemetry, StepRecord
from controller.core import ControllerCore

CAPS = EngineCapabilities(engine="vllm", max_batch_size=64, max_k=4, supports_trees=False, draft_method="ngram")
INFO = ReplicaInfo(capabilities=CAPS, node_id="node-a", node_ip="127.0.0.1", started_at=0.0)


def synthetic_step_time(batch, tokens, passes, context, prefill):
    """Seconds: max(memory floor, compute) + KV reads + drafting, the roofline's knee."""
    compute = 0.0009 * batch * tokens
    return max(0.04, compute) + 2e-6 * context + 0.00005 * prefill + 0.002 * passes


class SimulatedReplica:
    """Steps of a fixed batch under the policy it is given, with i.i.d. acceptance alpha."""

    def __init__(self, replica_id: str, alpha: float, seed: int = 0, model_id: str = "m"):
        self.replica_id, self.alpha, self.model_id = replica_id, alpha, model_id
        self.slowdown = 1.0  # its steps take this many times the synthetic step time (a busy machine)
        self.policy = SpecPolicy.parse("chain2")
        self.rng = np.random.default_rng(seed)

    def telemetry(self, start: float, seconds: float, batch: int, arrivals: int) -> ReplicaTelemetry:
        steps, t = [], start
        k_prev = self.policy.config_for(batch).depth
        while t < start + seconds:
            cfg = self.policy.config_for(batch)
            duration = self.slowdown * synthetic_step_time(batch, 1 + k_prev, cfg.depth, batch * 300, 0)
            t += duration
            drafted = [batch] * k_prev
            accepted, alive = [], batch
            for _ in range(k_prev):
                alive = int(self.rng.binomial(alive, self.alpha))
                accepted.append(alive)
            steps.append(StepRecord(
                time=t, duration_s=duration, batch_size=batch, num_decode_reqs=batch,
                scheduled_tokens=batch * (1 + k_prev), prefill_tokens=0, context_tokens=batch * 300,
                config=cfg, policy_version=self.policy.version, num_drafts=batch if k_prev else 0,
                drafted_per_pos=drafted, accepted_per_pos=accepted))
            k_prev = cfg.depth
        return ReplicaTelemetry(
            replica_id=self.replica_id, model_id=self.model_id, info=INFO, window_start=start,
            window_end=start + seconds, arrivals=arrivals, finished=arrivals, queue_length=0,
            running=batch, policy=self.policy, steps=steps)

    def run(self, core: ControllerCore, start: float, periods: int, batch: int, arrivals: int) -> float:
        t = start
        self.history: list[SpecPolicy] = []
        for _ in range(periods):
            tel = self.telemetry(t, 1.0, batch, arrivals)
            t += 1.0
            policy = core.report(tel, now=t).policy
            if policy is not None:
                self.policy = policy
            self.history.append(self.policy)
            core.refit()
        return t
