"""What the controller keeps between reports, and how one report updates it.

- Per replica (`Replica`): its acceptance model, its load (arrival rate, batch, output
  length, request latency), the policy in force, its last decision and its recent steps.
- Per deployment, i.e. model id (`Deployment`): one step-time model fed by every replica's
  steps, the steps seen per (batch bucket, config), the workload its cost table assumes
  (context per sequence, prefill per step, proposal rate) and the recent finished requests
  of the latency fits.

The load estimates decay in time (half-life LOAD_HALF_LIFE_S), not per report, so a replica
that reports late weighs what it says by the time that passed.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import (
    EngineCapabilities, ReplicaInfo, ReplicaTelemetry, RequestRecord, StepRecord, read_profile,
)
from controller.acceptance import AcceptanceModel, measured_proposal_rate
from controller.checkpoint import (
    AcceptanceState,
    ConfigRequests,
    DeploymentState,
    ReplicaState,
    SeenSteps,
    StepTimeState,
)
from controller.latency import LatencyFit, fit_request_latency
from controller.policy_search import CostTable, Decision, bucket_of
from controller.safety import ExplorationBudget, MeasuredSpeed
from controller.step_time import StepTimeModel, StepTimeScale, measured_context_per_seq

LOAD_HALF_LIFE_S = 5.0  # memory of the load estimates (arrival rate, batch, lengths)
VIEW_STEPS = 64  # steps kept per replica to compare predicted and measured step time
LATENCY_WINDOW = 256  # finished requests kept per (deployment, config) for the latency fit


def _ema(old: float | None, new: float, dt: float, half_life: float) -> float:
    if old is None:
        return new
    a = 1.0 - 0.5 ** (max(dt, 0.0) / half_life)
    return old + a * (new - old)


@dataclass
class Replica:
    model_id: str
    capabilities: EngineCapabilities
    acceptance: AcceptanceModel
    policy_in_force: SpecPolicy
    last_seen: float
    node_id: str = ""
    node_ip: str = ""
    actor_id: str = ""  # its Ray actor, hex ("" if not known)
    started_at: float = 0.0  # unix seconds its engine was ready (ReplicaInfo)
    first_decision_at: float | None = None  # unix seconds of the first policy decided for it
    started_warm: bool = False  # its acceptance started from counts its deployment had measured
    rate: float | None = None
    batch: float | None = None
    generated: float = 0.0  # decayed output tokens produced
    finished: float = 0.0  # decayed requests finished
    latency_sum: float = 0.0  # decayed seconds of the finished requests with records
    latency_count: float = 0.0
    recent_steps: list[StepRecord] = field(default_factory=list)
    decision: Decision | None = None
    last_probe: float = -1e18
    last_shadow: float = -1e18  # unix seconds of the last report with shadow acceptance counts
    last_off_check: float = -1e18  # unix seconds `off` was last run as a trial for the safety rule
    last_static_check: float = -1e18  # unix seconds the models' static choice was last run as a trial against `auto`
    # Guard rails (controller.safety); short-lived measurements, not checkpointed.
    measured: MeasuredSpeed = field(default_factory=MeasuredSpeed)
    budget: ExplorationBudget = field(default_factory=ExplorationBudget)
    exploring: bool = False  # the policy last decided is an exploration trial
    # The policy version the last trial runs under. A report's steps ran under the policy
    # decided a period before: they are a trial's if that decision was a trial and they ran
    # under its version (while the controller is paused, a policy set by hand runs instead).
    trial_version: int | None = None
    safety_overrides: int = 0  # decisions where measured speed overruled the models
    step_scale: StepTimeScale = field(default_factory=StepTimeScale)  # its steps against the deployment's model

    @classmethod
    def first_report(cls, tel: ReplicaTelemetry, info: ReplicaInfo, now: float,
                     acceptance: AcceptanceModel) -> Replica:
        """A replica not heard from before, starting from `acceptance` (its deployment's)."""
        return cls(tel.model_id, info.capabilities, acceptance, tel.policy, now,
                   node_id=info.node_id, node_ip=info.node_ip, actor_id=info.actor_id, started_at=info.started_at,
                   started_warm=acceptance.observed_drafts() > 0)

    @property
    def output_tokens(self) -> float | None:
        """Mean output tokens per request; None until enough requests finished."""
        return self.generated / self.finished if self.finished >= 1.0 else None

    @property
    def measured_latency_s(self) -> float | None:
        return self.latency_sum / self.latency_count if self.latency_count >= 1.0 else None

    def observe(self, tel: ReplicaTelemetry, now: float) -> float:
        """Take the replica's report at `now`; returns the seconds since its previous one,
        by which the deployment's estimates decay too."""
        dt = now - self.last_seen
        self.last_seen, self.policy_in_force = now, tel.policy
        if tel.info is not None:
            info = tel.info
            self.capabilities, self.node_id, self.node_ip, self.actor_id = (
                info.capabilities, info.node_id, info.node_ip, info.actor_id)
        steps = tel.steps
        changes = self.acceptance.changes
        self.acceptance.update(steps, now)
        if self.acceptance.changes > changes:
            # Speeds measured on the requests that ran before say nothing of the new ones'.
            self.measured = MeasuredSpeed()
        if any(s.shadow_seqs for s in steps):
            self.last_shadow = now
        self.measured.add(steps, self.capabilities.max_batch_size, now)
        trial_steps = sum(s.policy_version == self.trial_version for s in steps) if self.exploring else 0
        self.budget.add(len(steps), trial_steps, now)
        self.recent_steps = (self.recent_steps + steps)[-VIEW_STEPS:]
        span = max(tel.window_end - tel.window_start, 1e-3)
        self.rate = _ema(self.rate, tel.arrivals / span, dt, LOAD_HALF_LIFE_S)
        if steps:
            self.batch = _ema(self.batch, float(np.mean([s.batch_size for s in steps])), dt, LOAD_HALF_LIFE_S)
        # Decayed totals, not a mean of per-report ratios: a report often ends no request.
        keep = 0.5 ** (max(dt, 0.0) / (4 * LOAD_HALF_LIFE_S))
        self.generated = keep * self.generated + sum(s.num_decode_reqs + sum(s.accepted_per_pos) for s in steps)
        self.finished = keep * self.finished + tel.finished
        self.latency_sum = keep * self.latency_sum + sum(r.latency_s for r in tel.requests)
        self.latency_count = keep * self.latency_count + len(tel.requests)
        return dt

    def checkpoint(self) -> ReplicaState:
        return ReplicaState(
            model_id=self.model_id, capabilities=self.capabilities, node_id=self.node_id, node_ip=self.node_ip,
            actor_id=self.actor_id, started_at=self.started_at, first_decision_at=self.first_decision_at,
            started_warm=self.started_warm,
            policy_in_force=self.policy_in_force,
            last_seen=self.last_seen, acceptance=AcceptanceState.of(self.acceptance), rate=self.rate,
            batch=self.batch, generated=self.generated, finished=self.finished, latency_sum=self.latency_sum,
            latency_count=self.latency_count, recent_steps=self.recent_steps, last_probe=self.last_probe,
            step_scale=dataclasses.replace(self.step_scale))

    @property
    def deployment(self) -> str:
        """Its deployment's key in the controller: model, engine, accelerator."""
        return self.capabilities.deployment_key(self.model_id)

    @classmethod
    def restore(cls, state: ReplicaState, half_life_s: float) -> Replica:
        """`half_life_s`: the acceptance model's, from the controller's config."""
        return cls(
            model_id=state.model_id, capabilities=state.capabilities, node_id=state.node_id, node_ip=state.node_ip,
            actor_id=state.actor_id, started_at=state.started_at, first_decision_at=state.first_decision_at,
            started_warm=state.started_warm,
            acceptance=state.acceptance.model(half_life_s), policy_in_force=state.policy_in_force,
            last_seen=state.last_seen, rate=state.rate, batch=state.batch, generated=state.generated,
            finished=state.finished, latency_sum=state.latency_sum, latency_count=state.latency_count,
            recent_steps=list(state.recent_steps), last_probe=state.last_probe,
            step_scale=dataclasses.replace(state.step_scale))


@dataclass
class Deployment:
    step_model: StepTimeModel
    # Every replica's acceptance, pooled: where a replica that joins starts from.
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    seen: dict[tuple[int, SpecConfig], int] = field(default_factory=dict)  # (bucket lo, config) -> steps
    context_per_seq: float | None = None
    prefill_per_step: float | None = None
    proposal_rate: float | None = None  # share of decoding sequences that get a draft
    costs: CostTable | None = None
    costs_built_at: float = -1e18
    candidates: list[SpecConfig] | None = None  # configs to price (controller.core._candidates)
    candidates_at: float = -1e18
    model_version: int = 0
    costs_version: int = -1
    samples_at_fit: int = 0
    requests: dict[SpecConfig, deque[RequestRecord]] = field(default_factory=dict)  # config -> recent finished
    model_id: str = ""  # the model it serves (set by first_report and restore)

    @classmethod
    def first_report(cls, model_id: str, profile_path: str | None, half_life_s: float,
                     caps: EngineCapabilities | None = None) -> Deployment:
        """A model not seen before; its step-time model starts from the profile's steps of
        this model, if `profile_path` names a profile that has some, and those steps count
        as seen (the (bucket, config) pairs they measured need no exploring; `caps` gives the
        buckets). `half_life_s`: the pooled acceptance model's."""
        dep = cls(StepTimeModel(), AcceptanceModel(half_life_s=half_life_s), model_id=model_id)
        if profile_path:
            try:
                steps = read_profile(profile_path, model_id)[1]
            except ValueError:  # no steps of this model in the profile: start from none
                steps = []
            dep.step_model.add(steps)
            if caps is not None:
                dep.count_seen(steps, caps.max_batch_size)
        return dep

    def count_seen(self, steps: list[StepRecord], max_batch: int) -> None:
        for s in steps:
            key = (bucket_of(s.batch_size, max_batch)[0], s.config)
            self.seen[key] = self.seen.get(key, 0) + 1

    def observe(self, tel: ReplicaTelemetry, caps: EngineCapabilities, dt: float, now: float) -> None:
        """Take one replica's report at `now`; `caps`: that replica's engine, `dt`: the
        seconds since its previous report."""
        steps = tel.steps
        self.step_model.add(steps)
        self.acceptance.update(steps, now)
        self.count_seen(steps, caps.max_batch_size)
        for r in tel.requests:
            self.requests.setdefault(r.config, deque(maxlen=LATENCY_WINDOW)).append(r)
        proposal = measured_proposal_rate(steps)
        if proposal is not None:
            self.proposal_rate = _ema(self.proposal_rate, proposal, dt, LOAD_HALF_LIFE_S)
        context = measured_context_per_seq(steps)
        if context is not None:  # then the steps ran some sequences
            self.context_per_seq = _ema(self.context_per_seq, context, dt, LOAD_HALF_LIFE_S)
            self.prefill_per_step = _ema(self.prefill_per_step, float(np.mean([s.prefill_tokens for s in steps])),
                                         dt, LOAD_HALF_LIFE_S)

    def latency_fits(self) -> dict[SpecConfig, LatencyFit]:
        fits = {c: fit_request_latency(c, list(rs)) for c, rs in self.requests.items()}
        return {c: f for c, f in fits.items() if f is not None}

    def checkpoint(self) -> DeploymentState:
        """The costs are left out: rebuilt from the step-time model on the next decision."""
        return DeploymentState(
            step_model=StepTimeState.of(self.step_model), acceptance=AcceptanceState.of(self.acceptance),
            seen=[SeenSteps(batch_lo=lo, config=c, steps=n) for (lo, c), n in self.seen.items()],
            context_per_seq=self.context_per_seq, prefill_per_step=self.prefill_per_step,
            proposal_rate=self.proposal_rate, model_version=self.model_version,
            samples_at_fit=self.samples_at_fit,
            requests=[ConfigRequests(config=c, records=list(rs)) for c, rs in self.requests.items()],
            model_id=self.model_id)

    @classmethod
    def restore(cls, state: DeploymentState, half_life_s: float) -> Deployment:
        """`half_life_s`: the pooled acceptance model's, from the controller's config."""
        acceptance = state.acceptance.model(half_life_s) if state.acceptance else AcceptanceModel(half_life_s=half_life_s)
        return cls(
            step_model=state.step_model.model(), acceptance=acceptance,
            seen={(s.batch_lo, s.config): s.steps for s in state.seen},
            context_per_seq=state.context_per_seq, prefill_per_step=state.prefill_per_step,
            proposal_rate=state.proposal_rate, model_version=state.model_version,
            samples_at_fit=state.samples_at_fit,
            requests={r.config: deque(r.records, maxlen=LATENCY_WINDOW) for r in state.requests},
            model_id=state.model_id)
