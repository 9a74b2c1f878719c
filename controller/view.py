"""What the controller shows of itself (`adaspec status`, the /admin/controller route): per
replica its load, acceptance, policies and how well the models predict it, built from the
controller's state (controller.state) on each request.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict

from adaspec.policy import SpecConfig
from controller.latency import LatencyFit, break_even_rate
from controller.policy_search import candidate_configs
from controller.state import Deployment, Replica
from controller.step_time import FitReport, step_features

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
    node_id: str  # the Ray node it runs on ("" if not known)
    node_ip: str
    seconds_since_report: float
    seconds_to_first_decision: float | None  # from its engine being ready to its first policy decided
    started_warm: bool  # its acceptance model started from its deployment's, which had seen drafts
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
    predicted_step_s: float | None  # the model's prediction for the same steps, times step_scale
    step_scale: float = 1.0  # this replica's measured / predicted step time, recent (StepTimeScale)
    step_error: float | None = None  # relative error of step times predicted before they ran (decayed mean)
    step_error_unscaled: float | None = None  # the same without step_scale
    measured_latency_s: float | None  # mean request latency, recent requests (decayed)
    latency_fits: list[ConfigLatency]  # per config, from the deployment's measured requests
    exploration_share: float = 0.0  # of its recent steps, the share run under a trial config (decayed)
    exploring: bool = False  # the policy last decided is a trial
    safety_overrides: int = 0  # decisions where measured speed put `off` in place of the models' choice
    workload_changes: int = 0  # reports whose acceptance restarted its acceptance counts (a new workload)


class DeploymentView(BaseModel):
    """One deployment (a model's replicas) in total."""

    model_config = ConfigDict(extra="forbid")

    model_id: str
    key: str = ""  # the controller's key of it: model, engine, accelerator (EngineCapabilities.deployment_key)
    replicas: int
    nodes: int  # distinct Ray nodes its replicas run on
    arrival_rate: float  # requests/s, all replicas
    batch: float  # requests per step, summed over replicas
    conditional_acceptance: list[float]  # per position, pooled over replicas (a joining replica starts here)
    step_time_model: FitReport


class DroppedReplica(BaseModel):
    """A replica the controller stopped tracking."""

    model_config = ConfigDict(extra="forbid")

    replica_id: str
    node_id: str
    reason: str  # "its actor died" (Ray said so) or "silent" (no report for replica_timeout_s)
    last_report: float  # unix seconds of its last report
    dropped_at: float  # unix seconds


class ControllerView(BaseModel):
    model_config = ConfigDict(extra="forbid")

    paused: bool
    restored_from_checkpoint: bool
    decisions: int
    policies_pushed: int
    replicas: list[ReplicaView]
    deployments: list[DeploymentView]
    dropped: list[DroppedReplica] = []  # the latest replicas dropped, oldest first

    def deployment(self, model_id: str) -> DeploymentView | None:
        return next((d for d in self.deployments if d.model_id == model_id), None)

    def of_model(self, model_id: str) -> ControllerView:
        """The view of one model's deployment and replicas (the counters stay the controller's;
        dropped replicas are kept, since the controller no longer knows their model)."""
        return self.model_copy(update={"replicas": [r for r in self.replicas if r.model_id == model_id],
                                       "deployments": [d for d in self.deployments if d.model_id == model_id]})


def deployment_view(key: str, dep: Deployment, replicas: list[Replica]) -> DeploymentView:
    max_k = max((r.capabilities.max_k for r in replicas), default=0)
    return DeploymentView(
        model_id=dep.model_id, key=key, replicas=len(replicas), nodes=len({r.node_id for r in replicas}),
        arrival_rate=sum(r.rate or 0.0 for r in replicas), batch=sum(r.batch or 0.0 for r in replicas),
        conditional_acceptance=[round(float(p), 4) for p in dep.acceptance.conditional_rates()[:max_k, 0]],
        step_time_model=dep.step_model.report)


def config_latencies(fits: dict[SpecConfig, LatencyFit], output_tokens: float, rate: float) -> list[ConfigLatency]:
    """Each fitted config's latency curve at `output_tokens` per request and `rate`
    requests/s, with its break-even rate against `off` where `off` has a fit too."""
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


def recent_step_seconds(rep: Replica, dep: Deployment) -> tuple[float | None, float | None]:
    """A replica's mean step time over its recent steps, measured and as its deployment's
    step-time model predicts it (times the replica's step_scale); None without steps."""
    if not rep.recent_steps:
        return None, None
    measured = float(np.mean([s.duration_s for s in rep.recent_steps]))
    predicted = rep.step_scale.factor * float(np.mean(dep.step_model.predict(
        [step_features(s) for s in rep.recent_steps])))
    return measured, predicted


def replica_view(replica_id: str, rep: Replica, dep: Deployment, fits: dict[SpecConfig, LatencyFit],
                 now: float) -> ReplicaView:
    """`fits`: the deployment's latency fits, made once for all its replicas."""
    measured, predicted = recent_step_seconds(rep, dep)
    d = rep.decision
    rates = rep.acceptance.conditional_rates()[: rep.capabilities.max_k, 0]
    # What the controller priced for this deployment (trees follow its measured acceptance).
    configs = dep.costs.configs if dep.costs else candidate_configs(rep.capabilities.max_k,
                                                                    rep.capabilities.supports_trees)
    return ReplicaView(
        replica_id=replica_id, model_id=rep.model_id, node_id=rep.node_id, node_ip=rep.node_ip,
        seconds_since_report=now - rep.last_seen,
        seconds_to_first_decision=None if rep.first_decision_at is None else rep.first_decision_at - rep.started_at,
        started_warm=rep.started_warm,
        arrival_rate=rep.rate or 0.0, mean_batch=rep.batch or 0.0,
        output_tokens=rep.output_tokens or 0.0,
        conditional_acceptance=[round(float(r), 4) for r in rates],
        expected_length={str(c): round(rep.acceptance.expected_length(c), 4) for c in configs},
        policy_in_force=str(rep.policy_in_force),
        chosen_policy=str(d.policy) if d else None, decision_ms=1000 * d.elapsed_s if d else None,
        operating_batch=d.operating_batch if d else None,
        predicted_latency_s=d.predicted_latency_s if d else None,
        measured_step_s=measured, predicted_step_s=predicted, step_scale=round(rep.step_scale.factor, 4),
        step_error=rep.step_scale.error, step_error_unscaled=rep.step_scale.unscaled_error,
        measured_latency_s=rep.measured_latency_s,
        latency_fits=config_latencies(fits, rep.output_tokens or 128.0, rep.rate or 0.0),
        exploration_share=round(rep.budget.share, 4), exploring=rep.exploring, safety_overrides=rep.safety_overrides,
        workload_changes=rep.acceptance.changes)
