"""A discrete-event simulation of N replicas under Poisson load, driven by fitted models and
the same `ControllerCore` the Ray actor runs (`adaspec simulate`).

Each simulated replica runs continuous batching: arrivals queue, join the running batch up
to the engine's largest batch, take one step for their prompt, then decode; every step's
duration comes from the step-time model (tabulated per batch size and config) and every
sequence's accepted draft tokens are drawn from the acceptance model's per-position rates.
Every control period each replica reports its telemetry to the controller and applies the
policy it answers. Telemetry is summarised per (batch size, config) and period: one
StepRecord per group, durations averaged, acceptance counts summed.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, ReplicaInfo, ReplicaTelemetry, StepRecord
from controller.acceptance import measured_acceptance, measured_proposal_rate
from controller.config import ControllerConfig
from controller.core import ControllerCore
from controller.policy_search import CostTable, candidate_configs
from controller.step_time import StepTimeModel, measured_context_per_seq


@dataclass
class SimulatedEngine:
    """What the simulation takes as ground truth for one engine."""

    configs: list[SpecConfig]
    step_s: list[list[float]]  # [batch][config index] decode step seconds
    prefill_s_per_token: float
    acceptance: list[float]  # conditional acceptance per draft position, given a draft
    max_batch: int
    max_k: int
    model_id: str = "simulated"
    proposal_rate: float = 1.0  # share of decoding sequences that get a draft

    @classmethod
    def from_models(cls, step_model: StepTimeModel, acceptance: list[float], max_batch: int, max_k: int,
                    context_per_seq: float = 300.0, model_id: str = "simulated",
                    proposal_rate: float | None = None) -> SimulatedEngine:
        """`acceptance`: conditional rates per position with proposal failures counted as
        rejections at the first (the controller's estimator); split here into the proposal
        rate and the rate given a draft. `proposal_rate` None (never measured): every
        sequence gets a draft."""
        proposal_rate = 1.0 if proposal_rate is None else proposal_rate
        configs = candidate_configs(max_k, supports_trees=False)
        table = CostTable.build(step_model, configs, max_batch, context_per_seq, 0.0, proposal_rate)
        coef = step_model.coef if step_model.coef is not None else step_model.prior_coef
        given_draft = list(acceptance)
        if given_draft and proposal_rate > 0:
            given_draft[0] = min(1.0, given_draft[0] / proposal_rate)
        return cls(configs, table.step_s.tolist(), float(coef[3]), given_draft, max_batch, max_k, model_id,
                   proposal_rate)

    @property
    def info(self) -> ReplicaInfo:
        caps = EngineCapabilities(engine="vllm", max_batch_size=self.max_batch, max_k=self.max_k,
                                  supports_trees=False, draft_method="simulated")
        return ReplicaInfo(capabilities=caps, node_id="simulated")


@dataclass
class _Group:
    steps: int = 0
    seconds: float = 0.0
    decode: int = 0
    tokens: int = 0
    prefill: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafts: int = 0


class SimReplica:
    def __init__(self, replica_id: str, engine: SimulatedEngine, policy: SpecPolicy, rng: random.Random,
                 output_tokens: int, prompt_tokens: int, warmup_s: float = 0.0):
        self.id, self.engine, self.rng = replica_id, engine, rng
        self.warmup_s = warmup_s
        self.output_tokens, self.prompt_tokens = output_tokens, prompt_tokens
        self.waiting: deque[float] = deque()  # arrival times
        self.running: list[list[float]] = []  # [remaining tokens, arrival time, new (1/0)]
        self.latencies: list[float] = []
        self.set_policy(policy)
        self.t = 0.0

    def set_policy(self, policy: SpecPolicy) -> None:
        self.policy = policy
        self.lookup = [self.engine.configs.index(c) for c in policy.compile(self.engine.max_batch)]

    def run_until(self, t_end: float, arrivals: list[float]) -> ReplicaTelemetry:
        start, groups, finished = self.t, {}, 0
        arrivals_in, arrivals = arrivals, deque(arrivals)
        eng, rng = self.engine, self.rng
        while self.t < t_end:
            while arrivals and arrivals[0] <= self.t:
                self.waiting.append(arrivals.popleft())
            if not self.running and not self.waiting:
                self.t = arrivals[0] if arrivals else t_end
                continue
            admitted = 0
            while self.waiting and len(self.running) < eng.max_batch:
                self.running.append([float(self.output_tokens), self.waiting.popleft(), 1.0])
                admitted += 1
            b = len(self.running)
            ci = self.lookup[b]
            k = eng.configs[ci].depth
            duration = eng.step_s[b][ci] + eng.prefill_s_per_token * self.prompt_tokens * admitted
            self.t += duration
            g = groups.setdefault((b, ci), _Group(drafted=[0] * k, accepted=[0] * k))
            g.steps += 1
            g.seconds += duration
            g.prefill += self.prompt_tokens * admitted
            still = []
            for seq in self.running:
                if seq[2]:  # its prompt step: the first token, no drafts to verify yet
                    seq[2], gained = 0.0, 1
                else:
                    accepted, drafted = 0, k if k and rng.random() < eng.proposal_rate else 0
                    while accepted < drafted and rng.random() < eng.acceptance[accepted]:
                        accepted += 1
                    for i in range(drafted):
                        g.drafted[i] += 1
                    for i in range(accepted):
                        g.accepted[i] += 1
                    g.drafts += 1 if drafted else 0
                    g.decode += 1
                    g.tokens += 1 + drafted
                    gained = 1 + accepted
                seq[0] -= gained
                if seq[0] <= 0:
                    if seq[1] >= self.warmup_s:
                        self.latencies.append(self.t - seq[1])
                    finished += 1
                else:
                    still.append(seq)
            self.running = still
        steps = [StepRecord(
            time=t_end, duration_s=g.seconds / g.steps, batch_size=b, num_decode_reqs=g.decode // g.steps,
            scheduled_tokens=(g.tokens + g.prefill) // g.steps, prefill_tokens=g.prefill // g.steps,
            context_tokens=b * (self.prompt_tokens + self.output_tokens // 2),
            config=eng.configs[ci], policy_version=self.policy.version, num_drafts=g.drafts,
            drafted_per_pos=g.drafted, accepted_per_pos=g.accepted, draft_k=eng.configs[ci].depth)
            for (b, ci), g in groups.items()]
        return ReplicaTelemetry(
            replica_id=self.id, model_id=eng.model_id, window_start=start,
            window_end=t_end, arrivals=len(arrivals_in), finished=finished, queue_length=len(self.waiting),
            running=len(self.running), policy=self.policy, steps=steps)


class SimulationResult(BaseModel):
    replicas: int
    simulated_s: float
    wall_s: float
    speed: float  # simulated seconds per wall second
    rate: float  # requests/s over all replicas
    completed: int
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    final_policies: dict[str, int]  # policy text -> replicas running it at the end
    controller_decisions: int


def simulate(engine: SimulatedEngine, replicas: int, duration_s: float, rate: float,
             controller: ControllerConfig | None = None, policy: str = "chain2", seed: int = 0,
             output_tokens: int = 128, prompt_tokens: int = 200, period_s: float = 1.0,
             warmup_s: float = 0.0) -> SimulationResult:
    """Simulate `replicas` replicas sharing Poisson arrivals at `rate` requests/s (split at
    random); with `controller`, every replica reports every `period_s` and follows it, else
    all run the static `policy`. Latencies of requests that arrived before `warmup_s` are
    left out."""
    rng = random.Random(seed)
    core = ControllerCore(controller) if controller is not None else None
    start_policy = SpecPolicy.parse(policy)
    sims = [SimReplica(f"r{i}", engine, start_policy, random.Random(seed * 7919 + i), output_tokens,
                       prompt_tokens, warmup_s) for i in range(replicas)]
    eng_info = engine.info
    next_arrival = rng.expovariate(rate) if rate > 0 else float("inf")
    wall = time.perf_counter()
    t, last_refit = 0.0, -1e18
    while t < duration_s - 1e-9:
        t_end = min(t + period_s, duration_s)
        per_replica: list[list[float]] = [[] for _ in sims]
        while next_arrival < t_end:
            per_replica[rng.randrange(replicas)].append(next_arrival)
            next_arrival += rng.expovariate(rate)
        for sim, arrivals in zip(sims, per_replica):
            tel = sim.run_until(t_end, arrivals)
            if core is not None:
                reply = core.report(tel, now=t_end)
                if reply.send_info:  # its first report (as a real replica, it waits to be asked)
                    reply = core.report(tel.model_copy(update={"info": eng_info}), now=t_end)
                if reply.policy is not None:
                    sim.set_policy(reply.policy)
        if core is not None:
            core.drop_stale(t_end)
            if t_end - last_refit >= controller.refit_every_s:
                core.refit()
                last_refit = t_end
        t = t_end
    wall = time.perf_counter() - wall
    latencies = sorted(lat for s in sims for lat in s.latencies)
    latencies = latencies or [float("nan")]
    finals: dict[str, int] = {}
    for s in sims:
        finals[str(s.policy)] = finals.get(str(s.policy), 0) + 1
    return SimulationResult(
        replicas=replicas, simulated_s=duration_s, wall_s=wall, speed=duration_s / wall, rate=rate,
        completed=len(latencies), mean_latency_s=statistics.fmean(latencies),
        p50_latency_s=latencies[len(latencies) // 2], p99_latency_s=latencies[int(0.99 * (len(latencies) - 1))],
        final_policies=dict(sorted(finals.items(), key=lambda kv: -kv[1])[:5]),
        controller_decisions=core.decisions if core else 0)


def engine_from_profile(path: str, max_batch: int, max_k: int) -> SimulatedEngine:
    """Step-time model and acceptance fitted on the steps of an `adaspec profile` file."""
    from adaspec.telemetry import read_profile

    model_id, steps = read_profile(path)
    model = StepTimeModel()
    model.add(steps)
    model.fit()
    rates = measured_acceptance(steps, max_k)
    return SimulatedEngine.from_models(model, rates, max_batch, max_k, measured_context_per_seq(steps) or 0.0,
                                       model_id, measured_proposal_rate(steps))


def engine_from_checkpoint(path: str, max_batch: int | None = None, max_k: int | None = None) -> SimulatedEngine:
    """The step-time model and one replica's acceptance from a controller checkpoint;
    CheckpointError for a file that cannot be used (an old pickle one included)."""
    from controller.checkpoint_file import CheckpointError, read_checkpoint

    core = ControllerCore(ControllerConfig())
    core.load_state(read_checkpoint(Path(path)))
    if not core.deployments:
        raise CheckpointError(f"{path}: the checkpoint holds no fitted model yet")
    model_id, dep = next(iter(core.deployments.items()))
    reps = [r for r in core.replicas.values() if r.model_id == model_id]
    caps = reps[0].capabilities if reps else None
    max_batch = max_batch or (caps.max_batch_size if caps else 64)
    max_k = max_k or (caps.max_k if caps else 4)
    acceptance = reps[0].acceptance if reps else dep.acceptance
    rates = acceptance.conditional_rates()[:max_k, 0].tolist()
    return SimulatedEngine.from_models(dep.step_model, rates, max_batch, max_k,
                                       dep.context_per_seq or 300.0, model_id, dep.proposal_rate)

