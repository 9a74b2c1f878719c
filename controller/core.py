"""The controller's logic, free of Ray: replicas report telemetry, the controller answers
with a new policy when its models say one pays. The Ray actor (`controller.actor`) and the
simulator (`controller.simulate`) both drive this same object.

Per deployment (model id) it keeps one step-time model, fed by every replica's steps; per
replica an acceptance model and load estimates (arrival rate, batch, output length).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, ReplicaTelemetry, RequestRecord, StepRecord, read_profile
from controller.acceptance import AcceptanceModel, expected_accepted_length
from controller.checkpoint import (
    AcceptanceState,
    ConfigRequests,
    ControllerCheckpoint,
    DeploymentState,
    ReplicaState,
    SeenSteps,
    StepTimeState,
)
from controller.config import ControllerConfig
from controller.latency import LatencyFit, break_even_rate, fit_request_latency
from controller.policy_search import (
    CostTable,
    Decision,
    Objective,
    batch_buckets,
    candidate_configs,
    search_policy,
)
from controller.step_time import FitReport, StepTimeModel, step_features

LOAD_HALF_LIFE_S = 5.0  # memory of the load estimates (arrival rate, batch, lengths)
EXPLORE_STEPS = 20  # steps a (batch bucket, config) needs before the step-time model is trusted there
VIEW_STEPS = 64  # steps kept per replica to compare predicted and measured step time
LATENCY_WINDOW = 256  # finished requests kept per (deployment, config) for the latency fit


# JSON has no infinity: pydantic writes inf as null, and a view read back (the CLI, through
# the admin route) turns null into inf again.
Unbounded = Annotated[float, BeforeValidator(lambda v: math.inf if v is None else v)]


class ConfigLatency(BaseModel):
    """A config's measured latency curve, scaled to this replica's output length."""

    model_config = ConfigDict(extra="forbid")

    fit: LatencyFit
    c1_s: float  # latency of a lone request (seconds)
    c2_s: float  # latency added per concurrent request (seconds)
    saturation_rate: Unbounded  # requests/s where latency diverges (inf: never)
    latency_at_rate_s: Unbounded  # L = C1 / (1 - rate * C2) at the replica's arrival rate (inf: saturated)
    break_even_rate: float | None  # requests/s beyond which this config is slower than off


class ReplicaView(BaseModel):
    """The controller's view of one replica (for `adaspec status`)."""

    model_config = ConfigDict(extra="forbid")

    replica_id: str
    model_id: str
    seconds_since_report: float
    arrival_rate: float  # requests/s
    mean_batch: float  # requests per step
    output_tokens: float  # mean per request
    conditional_acceptance: list[float]  # per position, chains
    expected_length: dict[str, float]  # config -> predicted tokens per verify step
    policy_in_force: str
    chosen_policy: str | None
    decision_ms: float | None
    operating_batch: float | None
    predicted_latency_s: float | None
    measured_step_s: float | None  # mean over the last steps
    predicted_step_s: float | None  # the model's prediction for the same steps
    measured_latency_s: float | None  # mean request latency, recent requests (decayed)
    latency_fits: list[ConfigLatency]  # per config, from the deployment's measured requests


class ControllerView(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paused: bool
    restored_from_checkpoint: bool
    decisions: int
    policies_pushed: int
    replicas: list[ReplicaView]
    step_time_models: dict[str, FitReport]  # model id -> last fit


def _bucket_of(batch: int, max_batch: int) -> int:
    """The lower bound of the policy-search bucket holding `batch`."""
    for lo, hi in batch_buckets(max_batch):
        if lo <= batch <= hi:
            return lo
    return batch_buckets(max_batch)[-1][0]


def _bucket_hi(lo: int, max_batch: int) -> int:
    return dict(batch_buckets(max_batch))[lo]


def _ema(old: float | None, new: float, dt: float, half_life: float) -> float:
    if old is None:
        return new
    a = 1.0 - 0.5 ** (max(dt, 0.0) / half_life)
    return old + a * (new - old)


# _Replica and _Deployment keep their names and module: a pickle checkpoint of an earlier
# version names them (controller.checkpoint_file converts one once).
@dataclass
class _Replica:
    model_id: str
    capabilities: EngineCapabilities
    acceptance: AcceptanceModel
    policy_in_force: SpecPolicy
    last_seen: float
    rate: float | None = None
    batch: float | None = None
    generated: float = 0.0  # decayed output tokens produced
    finished: float = 0.0  # decayed requests finished
    latency_sum: float = 0.0  # decayed seconds of the finished requests with records
    latency_count: float = 0.0

    @property
    def output_tokens(self) -> float | None:
        """Mean output tokens per request; None until enough requests finished."""
        return self.generated / self.finished if self.finished >= 1.0 else None
    recent_steps: list[StepRecord] = field(default_factory=list)
    decision: Decision | None = None
    last_probe: float = -1e18

    @property
    def measured_latency_s(self) -> float | None:
        return self.latency_sum / self.latency_count if self.latency_count >= 1.0 else None

    def checkpoint(self) -> ReplicaState:
        return ReplicaState(
            model_id=self.model_id, capabilities=self.capabilities, policy_in_force=self.policy_in_force,
            last_seen=self.last_seen, acceptance=AcceptanceState.of(self.acceptance), rate=self.rate,
            batch=self.batch, generated=self.generated, finished=self.finished, latency_sum=self.latency_sum,
            latency_count=self.latency_count, recent_steps=self.recent_steps, last_probe=self.last_probe)

    @classmethod
    def restore(cls, state: ReplicaState, half_life_s: float) -> _Replica:
        """`half_life_s`: the acceptance model's, from the controller's config."""
        return cls(
            model_id=state.model_id, capabilities=state.capabilities,
            acceptance=state.acceptance.model(half_life_s), policy_in_force=state.policy_in_force,
            last_seen=state.last_seen, rate=state.rate, batch=state.batch, generated=state.generated,
            finished=state.finished, latency_sum=state.latency_sum, latency_count=state.latency_count,
            recent_steps=list(state.recent_steps), last_probe=state.last_probe)


@dataclass
class _Deployment:
    step_model: StepTimeModel
    seen: dict[tuple[int, SpecConfig], int] = field(default_factory=dict)  # (bucket lo, config) -> steps
    context_per_seq: float | None = None
    prefill_per_step: float | None = None
    proposal_rate: float | None = None  # share of decoding sequences that get a draft
    costs: CostTable | None = None
    costs_built_at: float = -1e18
    model_version: int = 0
    costs_version: int = -1
    samples_at_fit: int = 0
    requests: dict[SpecConfig, deque[RequestRecord]] = field(default_factory=dict)  # config -> recent finished

    def latency_fits(self) -> dict[SpecConfig, LatencyFit]:
        fits = {c: fit_request_latency(c, list(rs)) for c, rs in self.requests.items()}
        return {c: f for c, f in fits.items() if f is not None}

    def checkpoint(self) -> DeploymentState:
        """The costs are left out: rebuilt from the step-time model on the next decision."""
        return DeploymentState(
            step_model=StepTimeState.of(self.step_model),
            seen=[SeenSteps(batch_lo=lo, config=c, steps=n) for (lo, c), n in self.seen.items()],
            context_per_seq=self.context_per_seq, prefill_per_step=self.prefill_per_step,
            proposal_rate=self.proposal_rate, model_version=self.model_version,
            samples_at_fit=self.samples_at_fit,
            requests=[ConfigRequests(config=c, records=list(rs)) for c, rs in self.requests.items()])

    @classmethod
    def restore(cls, state: DeploymentState) -> _Deployment:
        return cls(
            step_model=state.step_model.model(),
            seen={(s.batch_lo, s.config): s.steps for s in state.seen},
            context_per_seq=state.context_per_seq, prefill_per_step=state.prefill_per_step,
            proposal_rate=state.proposal_rate, model_version=state.model_version,
            samples_at_fit=state.samples_at_fit,
            requests={r.config: deque(r.records, maxlen=LATENCY_WINDOW) for r in state.requests})


def _config_latencies(fits: dict[SpecConfig, LatencyFit], output_tokens: float, rate: float) -> list[ConfigLatency]:
    off = fits.get(SpecConfig.off())
    out = []
    for config, fit in sorted(fits.items(), key=lambda item: str(item[0])):
        coef = fit.coefficients(output_tokens)
        even = None
        if off is not None and not config.is_off:
            even = break_even_rate(off.coefficients(output_tokens), coef)
        out.append(ConfigLatency(fit=fit, c1_s=coef.c1_s, c2_s=coef.c2_s, saturation_rate=coef.saturation_rate,
                                 latency_at_rate_s=coef.mean_latency(rate), break_even_rate=even))
    return out


class ControllerCore:
    def __init__(self, config: ControllerConfig):
        self.config = config
        self.objective = Objective(config.objective, config.tpot_slo_s)
        self.replicas: dict[str, _Replica] = {}
        self.deployments: dict[str, _Deployment] = {}
        self.paused = False
        self.restored = False
        self.decisions = 0
        self.pushed = 0

    # ------------------------------------------------------------------ reports
    def report(self, tel: ReplicaTelemetry, now: float | None = None) -> SpecPolicy | None:
        """Take a replica's telemetry; return a policy to apply, or None to keep its own."""
        now = time.time() if now is None else now
        self.observe(tel, now)
        if self.paused:
            return None
        decision = self.decide(tel.replica_id, now)
        if decision is None or not decision.changed:
            return None
        self.pushed += 1
        return decision.policy

    def observe(self, tel: ReplicaTelemetry, now: float) -> None:
        rep = self.replicas.get(tel.replica_id)
        if rep is None:
            rep = _Replica(tel.model_id, tel.capabilities,
                           AcceptanceModel(half_life_s=self.config.half_life_s), tel.policy, now)
            self.replicas[tel.replica_id] = rep
        dt = now - rep.last_seen
        rep.last_seen, rep.capabilities, rep.policy_in_force = now, tel.capabilities, tel.policy
        steps = tel.steps
        rep.acceptance.update(steps, now)
        rep.recent_steps = (rep.recent_steps + steps)[-VIEW_STEPS:]
        span = max(tel.window_end - tel.window_start, 1e-3)
        rep.rate = _ema(rep.rate, tel.arrivals / span, dt, LOAD_HALF_LIFE_S)
        if steps:
            rep.batch = _ema(rep.batch, float(np.mean([s.batch_size for s in steps])), dt, LOAD_HALF_LIFE_S)
        # Decayed totals, not a mean of per-report ratios: a report often ends no request.
        keep = 0.5 ** (max(dt, 0.0) / (4 * LOAD_HALF_LIFE_S))
        rep.generated = keep * rep.generated + sum(s.num_decode_reqs + sum(s.accepted_per_pos) for s in steps)
        rep.finished = keep * rep.finished + tel.finished
        rep.latency_sum = keep * rep.latency_sum + sum(r.latency_s for r in tel.requests)
        rep.latency_count = keep * rep.latency_count + len(tel.requests)

        dep = self.deployments.get(tel.model_id)
        if dep is None:
            dep = self.deployments[tel.model_id] = _Deployment(StepTimeModel())
            if self.config.profile_path:
                try:
                    dep.step_model.add(read_profile(self.config.profile_path, tel.model_id)[1])
                except ValueError:  # no steps of this model in the profile: start from none
                    pass
        dep.step_model.add(steps)
        for s in steps:
            key = (_bucket_of(s.batch_size, tel.capabilities.max_batch_size), s.config)
            dep.seen[key] = dep.seen.get(key, 0) + 1
        for r in tel.requests:
            dep.requests.setdefault(r.config, deque(maxlen=LATENCY_WINDOW)).append(r)
        eligible = sum(s.num_decode_reqs for s in steps if s.draft_k >= 1)
        if eligible:
            proposed = sum(s.num_drafts for s in steps if s.draft_k >= 1)
            dep.proposal_rate = _ema(dep.proposal_rate, min(proposed / eligible, 1.0), dt, LOAD_HALF_LIFE_S)
        seqs = sum(s.batch_size for s in steps)
        if seqs:
            dep.context_per_seq = _ema(dep.context_per_seq, sum(s.context_tokens for s in steps) / seqs,
                                       dt, LOAD_HALF_LIFE_S)
            dep.prefill_per_step = _ema(dep.prefill_per_step,
                                        float(np.mean([s.prefill_tokens for s in steps])), dt, LOAD_HALF_LIFE_S)

    # ------------------------------------------------------------------ decisions
    def _costs(self, dep: _Deployment, caps: EngineCapabilities, now: float) -> CostTable:
        stale = now - dep.costs_built_at >= self.config.period_s or dep.costs_version != dep.model_version
        wanted = candidate_configs(caps.max_k, caps.supports_trees)
        if dep.costs is None or stale or dep.costs.configs != wanted \
                or dep.costs.max_batch != caps.max_batch_size:
            dep.costs = CostTable.build(dep.step_model, wanted, caps.max_batch_size,
                                        dep.context_per_seq or 256.0, dep.prefill_per_step or 0.0,
                                        1.0 if dep.proposal_rate is None else dep.proposal_rate)
            dep.costs_built_at, dep.costs_version = now, dep.model_version
        return dep.costs

    def decide(self, replica_id: str, now: float) -> Decision | None:
        rep = self.replicas[replica_id]
        dep = self.deployments[rep.model_id]
        costs = self._costs(dep, rep.capabilities, now)
        marginal = rep.acceptance.marginal_rates()
        expected = np.array([expected_accepted_length(c, marginal) for c in costs.configs])
        decision = search_policy(
            costs, expected, rate=rep.rate or 0.0, output_tokens=rep.output_tokens or 128.0,
            objective=self.objective, current=rep.policy_in_force, hysteresis=self.config.hysteresis,
            version=max(time.time_ns() // 1_000_000, rep.policy_in_force.version + 1),
            replica_id=replica_id)
        decision = self._explore(decision, rep, dep, now)
        rep.decision = decision
        self.decisions += 1
        return decision

    def _explore(self, decision: Decision, rep: _Replica, dep: _Deployment, now: float) -> Decision:
        """Run another config than the chosen one for one period, in the bucket the replica
        runs in now, when the models cannot know the answer without trying:
        - an unmeasured neighbour (k-1, then k+1): the step-time model cannot tell from data
          how a config never seen at this batch would do (a chain3 step at batch 48 says
          nothing about the cost of `off` there);
        - chain1 every `probe_every_s` while the bucket is off: with no drafts the
          acceptance model learns nothing, and the workload may have changed."""
        if rep.batch is None:
            return decision
        caps = rep.capabilities
        lo = _bucket_of(max(int(round(rep.batch)), 1), caps.max_batch_size)
        chosen = decision.policy.config_for(lo)
        if not chosen.is_chain:
            return decision
        trial = None
        for k in (chosen.depth - 1, chosen.depth + 1):
            if 0 <= k <= caps.max_k and dep.seen.get((lo, SpecConfig.chain(k)), 0) < EXPLORE_STEPS:
                trial = SpecConfig.chain(k)
                break
        if trial is None and chosen.is_off and caps.max_k >= 1 and now - rep.last_probe >= self.config.probe_every_s:
            trial = SpecConfig.chain(1)
        if trial is None:
            return decision
        if trial.depth and chosen.is_off:
            rep.last_probe = now
        policy = decision.policy.with_configs(lo, _bucket_hi(lo, caps.max_batch_size), trial)
        return decision.model_copy(update={"policy": policy, "changed": not policy.same_rules(rep.policy_in_force)})

    # ------------------------------------------------------------------ upkeep
    def refit_jobs(self) -> dict[str, StepTimeModel]:
        """Copies of the step-time models that gained 10% new samples since their last fit;
        fit them anywhere (a thread), then hand them to install_fit."""
        jobs = {}
        for model_id, dep in self.deployments.items():
            n = len(dep.step_model.y)
            if n >= 8 and n >= 1.1 * dep.samples_at_fit:
                jobs[model_id] = dataclasses.replace(dep.step_model, x=list(dep.step_model.x),
                                                     y=list(dep.step_model.y))
        return jobs

    def install_fit(self, model_id: str, fitted: StepTimeModel) -> None:
        dep = self.deployments[model_id]
        dep.step_model.coef, dep.step_model.booster = fitted.coef, fitted.booster
        dep.step_model.report = fitted.report
        dep.samples_at_fit = len(fitted.y)
        dep.model_version += 1

    def refit(self) -> dict[str, FitReport]:
        """Refit in place (the simulator; the actor fits the jobs in a thread)."""
        reports = {}
        for model_id, job in self.refit_jobs().items():
            reports[model_id] = job.fit()
            self.install_fit(model_id, job)
        return reports

    def drop_stale(self, now: float) -> list[str]:
        gone = [rid for rid, r in self.replicas.items() if now - r.last_seen > self.config.replica_timeout_s]
        for rid in gone:
            del self.replicas[rid]
        return gone

    def view(self, now: float | None = None) -> ControllerView:
        now = time.time() if now is None else now
        views = []
        fits = {model_id: dep.latency_fits() for model_id, dep in self.deployments.items()}
        for rid, rep in self.replicas.items():
            dep = self.deployments[rep.model_id]
            measured = predicted = None
            if rep.recent_steps:
                measured = float(np.mean([s.duration_s for s in rep.recent_steps]))
                predicted = float(np.mean(dep.step_model.predict([step_features(s) for s in rep.recent_steps])))
            d = rep.decision
            rates = rep.acceptance.conditional_rates()[: rep.capabilities.max_k, 0]
            configs = candidate_configs(rep.capabilities.max_k, rep.capabilities.supports_trees)
            views.append(ReplicaView(
                replica_id=rid, model_id=rep.model_id, seconds_since_report=now - rep.last_seen,
                arrival_rate=rep.rate or 0.0, mean_batch=rep.batch or 0.0,
                output_tokens=rep.output_tokens or 0.0,
                conditional_acceptance=[round(float(r), 4) for r in rates],
                expected_length={str(c): round(rep.acceptance.expected_length(c), 4) for c in configs},
                policy_in_force=str(rep.policy_in_force),
                chosen_policy=str(d.policy) if d else None, decision_ms=1000 * d.elapsed_s if d else None,
                operating_batch=d.operating_batch if d else None,
                predicted_latency_s=d.predicted_latency_s if d else None,
                measured_step_s=measured, predicted_step_s=predicted,
                measured_latency_s=rep.measured_latency_s,
                latency_fits=_config_latencies(fits[rep.model_id], rep.output_tokens or 128.0, rep.rate or 0.0)))
        return ControllerView(
            paused=self.paused, restored_from_checkpoint=self.restored, decisions=self.decisions,
            policies_pushed=self.pushed, replicas=views,
            step_time_models={m: d.step_model.report for m, d in self.deployments.items()})

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> ControllerCheckpoint:
        """Everything a restarted controller needs (controller.checkpoint). A snapshot: its
        lists are copies, so it can be written out in a thread while reports go on."""
        return ControllerCheckpoint(
            replicas={rid: rep.checkpoint() for rid, rep in self.replicas.items()},
            deployments={model_id: dep.checkpoint() for model_id, dep in self.deployments.items()},
            paused=self.paused, decisions=self.decisions, pushed=self.pushed)

    def load_state(self, ckpt: ControllerCheckpoint) -> None:
        """Resume from a checkpoint: its models, load estimates and policies in force."""
        replicas = {rid: _Replica.restore(r, self.config.half_life_s) for rid, r in ckpt.replicas.items()}
        deployments = {model_id: _Deployment.restore(d) for model_id, d in ckpt.deployments.items()}
        self.replicas, self.deployments = replicas, deployments  # all or nothing
        self.paused, self.decisions, self.pushed = ckpt.paused, ckpt.decisions, ckpt.pushed
        self.restored = True
