"""The controller's Prometheus metrics (through Ray's metrics agent, as `ray_adaspec_controller_*`):
what it decided and why, per model and replica, after every report. The series a dashboard
needs to tell whether the controller helps: decisions, policies pushed, the share of steps
spent exploring, the safety rule stepping in, and its step-time model against the steps it
predicts.
"""

from __future__ import annotations

from ray.util import metrics

from adaspec.telemetry import ReplicaTelemetry
from controller.core import ControllerCore
from controller.view import recent_step_seconds

TAGS = ("model_name", "replica")


class ControllerMetrics:
    def __init__(self, core: ControllerCore) -> None:
        """`core`: the controller's state as it starts (a resumed one's counts are not new)."""
        self.decisions = metrics.Counter(
            "adaspec_controller_decisions", "policy decisions made (one per report the controller acts on)",
            tag_keys=TAGS)
        self.pushes = metrics.Counter(
            "adaspec_controller_policy_pushes", "new policies sent to a replica", tag_keys=TAGS)
        self.safety_overrides = metrics.Counter(
            "adaspec_controller_safety_overrides",
            "decisions where measured speed put `off` in place of the models' choice", tag_keys=TAGS)
        self.exploration_share = metrics.Gauge(
            "adaspec_controller_exploration_share", "share of the replica's recent steps run under a trial config",
            tag_keys=TAGS)
        self.step_seconds = metrics.Gauge(
            "adaspec_controller_step_seconds",
            "mean engine step time over the replica's recent steps: measured, and as the step-time model predicts it",
            tag_keys=TAGS + ("source",))
        # replica -> its safety_overrides already counted
        self._overrides_seen = {rid: rep.safety_overrides for rid, rep in core.replicas.items()}

    def observe(self, core: ControllerCore, tel: ReplicaTelemetry, decisions: int, pushed: bool) -> None:
        """After `core` took the report `tel`: `decisions` it made, whether it pushed a policy."""
        replica_id = tel.replica_id
        rep = core.replicas.get(replica_id)
        if rep is None:  # asked for its info, report not taken
            return
        tags = {"model_name": rep.model_id, "replica": replica_id}
        if decisions:
            self.decisions.inc(decisions, tags=tags)
        if pushed:
            self.pushes.inc(1, tags=tags)
        if replica_id not in self._overrides_seen:
            # A counter's series exists from 0 (Prometheus practice: `increase()` then reads
            # 0, not nothing, until the rule fires); Ray's Counter.inc refuses 0.
            self.safety_overrides._record(0, tags=tags)
        new_overrides = rep.safety_overrides - self._overrides_seen.get(replica_id, 0)
        if new_overrides > 0:
            self.safety_overrides.inc(new_overrides, tags=tags)
        self._overrides_seen[replica_id] = rep.safety_overrides
        self.exploration_share.set(rep.budget.share, tags=tags)
        if not tel.steps:  # the recent steps are those of the last report: the gauges stand
            return
        measured, predicted = recent_step_seconds(rep, core.deployments[rep.deployment])
        if measured is not None:
            self.step_seconds.set(measured, tags={**tags, "source": "measured"})
            self.step_seconds.set(predicted, tags={**tags, "source": "predicted"})

    def forget(self, replica_ids: list[str]) -> None:
        for rid in replica_ids:
            self._overrides_seen.pop(rid, None)
