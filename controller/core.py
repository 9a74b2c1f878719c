"""The controller's logic, free of Ray: replicas report telemetry, the controller answers
with a new policy when its models say one pays. The Ray actor (`controller.actor`) and the
simulator (`controller.simulate`) both drive this same object.

What it keeps per replica and per deployment, and how a report updates that, is
`controller.state`; what it shows of itself, `controller.view`. Here: when to decide, which
config to try when the models cannot know, and the upkeep (refits, silent replicas,
checkpoints).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import numpy as np

from prepare.models import shipped_profile
from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import ControllerReply, EngineCapabilities, PolicySpeed, ReplicaTelemetry
from controller.acceptance import expected_accepted_length
from controller.checkpoint import ControllerCheckpoint
from controller.config import ControllerConfig
from controller.policy_search import (
    CostTable, Decision, Objective, bucket_of, candidate_configs, policy_speed, search_policy,
)
from controller.safety import prefer_budgets, safe_config
from controller.state import Deployment, Replica
from controller.step_time import FitReport, StepTimeModel, step_features
from controller.view import ControllerView, DroppedReplica, deployment_view, replica_view

# A report this many periods overdue makes the controller ask Ray whether the replica died:
# reports come every period plus the time one takes, so a live replica is rarely this late,
# and a wrong guess costs one query.
LATE_AFTER_PERIODS = 1.25
EXPLORE_STEPS = 20  # steps a (batch bucket, config) needs before the step-time model is trusted there
DROPPED_SHOWN = 16  # replicas that left, kept for the view


class ControllerCore:
    def __init__(self, config: ControllerConfig):
        self.config = config
        self.objective = Objective(config.objective, config.tpot_slo_s)
        self.replicas: dict[str, Replica] = {}
        self.deployments: dict[str, Deployment] = {}
        self.paused = False
        self.restored = False
        self.decisions = 0
        self.pushed = 0
        self.dropped: deque[DroppedReplica] = deque(maxlen=DROPPED_SHOWN)

    # ------------------------------------------------------------------ reports
    def report(self, tel: ReplicaTelemetry, now: float | None = None) -> ControllerReply:
        """Take a replica's telemetry; answer with a policy to apply, or none to keep its own.
        A replica not known here that sent no `info` is asked for it (and its report is
        not taken: it resends at once)."""
        now = time.time() if now is None else now
        if tel.replica_id not in self.replicas and tel.info is None:
            return ControllerReply(send_info=True)
        self.observe(tel, now)
        rep = self.replicas[tel.replica_id]
        costs, expected = self._models_for(rep, now)  # one evaluation for the decision and the speed
        policy = None
        # A window without steps (an idle replica) teaches the models nothing and changes no
        # input of the decision, so the policy in force stays: no new version every period.
        # A replica not decided for yet still gets its first (warm) policy, and one that runs
        # another policy than the one decided for it (set by hand while the controller was
        # paused) gets the controller's back now, not a step into the next burst: a burst's
        # first steps take seconds, all of them under the stale policy.
        idle = (not tel.steps and rep.decision is not None
                and rep.policy_in_force.same_rules(rep.decision.policy))
        if not self.paused and not idle:
            decision = self._decide(tel.replica_id, costs, expected, now)
            if decision.changed:
                self.pushed += 1
                policy = decision.policy
        return ControllerReply(policy=policy, speed=policy_speed(costs, expected, policy or rep.policy_in_force))

    def observe(self, tel: ReplicaTelemetry, now: float) -> None:
        """Update the replica's state and its deployment's from a report, deciding nothing.
        A replica new here starts from its deployment's acceptance (a warm start). A
        deployment is a model on one engine and accelerator (EngineCapabilities.deployment_key)."""
        rep = self.replicas.get(tel.replica_id)
        if rep is None and tel.info is None:
            raise ValueError(f"replica {tel.replica_id}: first report without `info`")
        caps = rep.capabilities if rep is not None else tel.info.capabilities
        key = caps.deployment_key(tel.model_id)
        dep = self.deployments.get(key)
        if dep is None:
            dep = self.deployments[key] = Deployment.first_report(
                tel.model_id, self._profile_for(tel.model_id, caps), self.config.half_life_s, caps)
        if rep is None:
            rep = self.replicas[tel.replica_id] = Replica.first_report(
                tel, tel.info, now, dep.acceptance.copy(self.config.half_life_s))
        dt = rep.observe(tel, now)
        # Before the deployment's model learns these steps: the scale's error stays out of sample.
        decode = [s for s in tel.steps if s.num_decode_reqs and not s.prefill_tokens and s.duration_s > 0]
        if decode:
            rep.step_scale.update(np.array([s.duration_s for s in decode]),
                                  dep.step_model.predict([step_features(s) for s in decode]), now)
        dep.observe(tel, rep.capabilities, dt, now)

    def _profile_for(self, model_id: str, caps: EngineCapabilities | None) -> str | None:
        """The configured profile, else the one shipped for this model and engine, on a CPU
        (where the shipped ones were measured; elsewhere they would mislead more than help)."""
        if self.config.profile_path or not self.config.shipped_profile or caps is None or caps.accelerator != "cpu":
            return self.config.profile_path
        path = shipped_profile(model_id, caps.engine)
        return str(path) if path else None

    # ------------------------------------------------------------------ decisions
    def _candidates(self, dep: Deployment, rep: Replica, now: float) -> list[SpecConfig]:
        """The configs to price: off, the chains and, for a tree engine, the trees built from
        the deployment's acceptance (re-chosen every refit period, not every report), plus the
        configs the reporting replica runs now, so that hysteresis can keep them (kept until
        the next re-choice, so every replica's stay priced without a pass over all replicas).
        Per-request budgets are never priced: the models cannot (controller.safety)."""
        caps = rep.capabilities
        if dep.candidates is None or now - dep.candidates_at >= self.config.refit_every_s:
            q = dep.acceptance.marginal_rates() if dep.acceptance.observed_drafts() > 0 else None
            dep.candidates = candidate_configs(caps.max_k, caps.supports_trees, q, caps.max_tree_nodes)
            dep.candidates_at = now
        for rule in rep.policy_in_force.rules:
            c = rule.config
            if (c not in dep.candidates and not c.per_request and c.depth <= caps.max_k
                    and (c.is_chain or caps.supports_trees)):
                dep.candidates.append(c)
        return list(dep.candidates)  # a copy: the cost table keeps the list it was built for

    def _costs(self, dep: Deployment, rep: Replica, now: float) -> CostTable:
        caps = rep.capabilities
        stale = now - dep.costs_built_at >= self.config.period_s or dep.costs_version != dep.model_version
        wanted = self._candidates(dep, rep, now)
        if dep.costs is None or stale or dep.costs.configs != wanted \
                or dep.costs.max_batch != caps.max_batch_size:
            dep.costs = CostTable.build(dep.step_model, wanted, caps.max_batch_size,
                                        dep.context_per_seq or 256.0, dep.prefill_per_step or 0.0,
                                        1.0 if dep.proposal_rate is None else dep.proposal_rate)
            dep.costs_built_at, dep.costs_version = now, dep.model_version
        return dep.costs

    def _models_for(self, rep: Replica, now: float) -> tuple[CostTable, np.ndarray]:
        """The replica's deployment's cost table, scaled to how fast its steps run now
        (StepTimeScale), and E(c) per config of it: tokens a sequence gains per step on this
        replica."""
        costs = self._costs(self.deployments[rep.deployment], rep, now).scaled(rep.step_scale.factor)
        marginal = rep.acceptance.marginal_rates()
        return costs, np.array([expected_accepted_length(c, marginal) for c in costs.configs])

    def speed(self, replica_id: str, policy: SpecPolicy, now: float) -> PolicySpeed | None:
        """Predicted seconds per output token per batch bucket of a known replica under
        `policy` (the request router's view of it; controller.policy_search.policy_speed)."""
        return policy_speed(*self._models_for(self.replicas[replica_id], now), policy)

    def decide(self, replica_id: str, now: float) -> Decision:
        return self._decide(replica_id, *self._models_for(self.replicas[replica_id], now), now)

    def _decide(self, replica_id: str, costs: CostTable, expected: np.ndarray, now: float) -> Decision:
        rep = self.replicas[replica_id]
        dep = self.deployments[rep.deployment]
        models = search_policy(
            costs, expected, rate=rep.rate or 0.0, output_tokens=rep.output_tokens or 128.0,
            objective=self.objective, current=rep.policy_in_force, hysteresis=self.config.hysteresis,
            version=max(time.time_ns() // 1_000_000, rep.policy_in_force.version + 1),
            replica_id=replica_id)
        decision = self._budgets(models, rep)
        decision = self._guard(decision, rep)
        decision = self._explore(decision, rep, dep, now, models.policy)
        rep.decision = decision
        if rep.first_decision_at is None:
            rep.first_decision_at = now
        self.decisions += 1
        return decision

    def _budgets(self, decision: Decision, rep: Replica) -> Decision:
        """Per-request budgets (controller.safety.prefer_budgets): in the bucket the replica
        runs in now, `auto` replaces the models' choice where it was measured faster."""
        if rep.batch is None or not rep.capabilities.supports_budgets:
            return decision
        lo, hi = bucket_of(max(int(round(rep.batch)), 1), rep.capabilities.max_batch_size)
        chosen = decision.policy.config_for(lo)
        pick = prefer_budgets(chosen, lo, rep.policy_in_force.config_for(lo), rep.measured, rep.last_seen,
                              self.config.safety_margin)
        if pick == chosen:
            return decision
        policy = decision.policy.with_configs(lo, hi, pick)
        return dataclasses.replace(decision, policy=policy, changed=not policy.same_rules(rep.policy_in_force))

    def _guard(self, decision: Decision, rep: Replica) -> Decision:
        """The safety rule (controller.safety): in the bucket the replica runs in now, `off`
        replaces a speculative config that was measured slower per token than `off` there."""
        if rep.batch is None:
            return decision
        lo, hi = bucket_of(max(int(round(rep.batch)), 1), rep.capabilities.max_batch_size)
        chosen = decision.policy.config_for(lo)
        safe = safe_config(chosen, lo, rep.measured, rep.last_seen, self.config.safety_margin)
        if safe == chosen:
            return decision
        rep.safety_overrides += 1
        policy = decision.policy.with_configs(lo, hi, safe)
        return dataclasses.replace(decision, policy=policy, changed=not policy.same_rules(rep.policy_in_force))

    def _explore(self, decision: Decision, rep: Replica, dep: Deployment, now: float,
                 models_policy: SpecPolicy) -> Decision:
        """Run another config than the chosen one for one period, in the bucket the replica
        runs in now, when the models (or the safety rule) cannot know the answer without
        trying. `models_policy`: what the models chose, before the measured rules."""
        trial = None
        if rep.batch is not None:
            lo, hi = bucket_of(max(int(round(rep.batch)), 1), rep.capabilities.max_batch_size)
            trial = self._trial(decision.policy.config_for(lo), models_policy.config_for(lo), lo, rep, dep, now)
        rep.exploring = trial is not None
        if trial is None:
            return decision
        if trial.is_off:
            rep.last_off_check = now
        elif decision.policy.config_for(lo).is_off:
            rep.last_probe = now
        policy = decision.policy.with_configs(lo, hi, trial)
        changed = not policy.same_rules(rep.policy_in_force)
        # Unchanged rules are not pushed: the replica goes on under the version in force.
        rep.trial_version = policy.version if changed else rep.policy_in_force.version
        return dataclasses.replace(decision, policy=policy, changed=changed)

    def _trial(self, chosen: SpecConfig, static: SpecConfig, lo: int, rep: Replica, dep: Deployment,
               now: float) -> SpecConfig | None:
        """The config to try in bucket `lo` instead of `chosen`, if any:
        - an unmeasured neighbour (k-1, then k+1): the step-time model cannot tell from data
          how a config never seen at this batch would do (a chain3 step at batch 48 says
          nothing about the cost of `off` there). Once per deployment, bucket and config, so
          bounded in total (a shipped profile has measured most of them);
        - `auto` (per-request budgets) once per deployment and bucket, on an engine that runs
          them: only a measurement can price it (controller.safety.prefer_budgets);
        Recurring trials, only while trials are under `max_exploration_share` of the
        replica's recent steps:
        - the models' static choice, every `safety_recheck_s` while the bucket runs `auto`
          and that choice has no recent measurement there: `auto` must keep beating it;
        - `off`, every `safety_recheck_s` while the bucket speculates and `off` has no recent
          measurement there: the safety rule compares against it;
        - chain1 every `probe_every_s` while the bucket is off: with no drafts the
          acceptance model learns nothing, and the workload may have changed. Not while the
          replica's steps carry shadow counts (prompt lookup): they measure every chain."""
        caps = rep.capabilities
        auto = SpecConfig.budget()
        if caps.supports_budgets and chosen != auto and dep.seen.get((lo, auto), 0) < EXPLORE_STEPS:
            return auto
        if chosen == auto:  # `static`: the models' choice, which auto must keep beating
            if (static != auto and now - rep.last_static_check >= self.config.safety_recheck_s
                    and rep.budget.allows_trial(self.config.max_exploration_share)
                    and not rep.measured.measured_recently(lo, static, rep.last_seen)):
                rep.last_static_check = now
                return static
            return None
        if not chosen.is_chain:
            return None
        for k in (chosen.depth - 1, chosen.depth + 1):
            if 0 <= k <= caps.max_k and dep.seen.get((lo, SpecConfig.chain(k)), 0) < EXPLORE_STEPS:
                return SpecConfig.chain(k)
        if not rep.budget.allows_trial(self.config.max_exploration_share):
            return None
        if (not chosen.is_off and now - rep.last_off_check >= self.config.safety_recheck_s
                and not rep.measured.measured_recently(lo, SpecConfig.off(), rep.last_seen)):
            return SpecConfig.off()
        if (chosen.is_off and caps.max_k >= 1 and now - rep.last_probe >= self.config.probe_every_s
                and now - rep.last_shadow >= self.config.probe_every_s):
            return SpecConfig.chain(1)
        return None

    # ------------------------------------------------------------------ upkeep
    def refit_jobs(self) -> dict[str, StepTimeModel]:
        """Copies of the step-time models that gained 10% new samples since their last fit, by
        deployment key; fit them anywhere (a thread), then hand them to install_fit."""
        jobs = {}
        for key, dep in self.deployments.items():
            n = len(dep.step_model.y)
            if n >= 8 and n >= 1.1 * dep.samples_at_fit:
                jobs[key] = dataclasses.replace(dep.step_model, x=list(dep.step_model.x), y=list(dep.step_model.y))
        return jobs

    def install_fit(self, key: str, fitted: StepTimeModel) -> None:
        dep = self.deployments[key]
        dep.step_model.coef, dep.step_model.booster = fitted.coef, fitted.booster
        dep.step_model.report = fitted.report
        dep.samples_at_fit = len(fitted.y)
        dep.model_version += 1

    def refit(self) -> dict[str, FitReport]:
        """Refit in place (the simulator; the actor fits the jobs in a thread)."""
        reports = {}
        for key, job in self.refit_jobs().items():
            reports[key] = job.fit()
            self.install_fit(key, job)
        return reports

    def drop_stale(self, now: float) -> list[str]:
        gone = [rid for rid, r in self.replicas.items() if now - r.last_seen > self.config.replica_timeout_s]
        return self.drop(gone, "silent", now)

    def late(self, now: float) -> dict[str, str]:
        """Replicas whose report is overdue (silent LATE_AFTER_PERIODS periods), by id -> Ray
        actor id: the ones worth asking Ray about before replica_timeout_s drops them anyway."""
        return {rid: r.actor_id for rid, r in self.replicas.items()
                if r.actor_id and now - r.last_seen > LATE_AFTER_PERIODS * self.config.period_s}

    def drop(self, replica_ids: list[str], reason: str = "", now: float | None = None) -> list[str]:
        """Forget these replicas (they left); the view lists the latest DROPPED_SHOWN of them."""
        now = time.time() if now is None else now
        for rid in replica_ids:
            rep = self.replicas.pop(rid, None)
            if rep is not None:
                self.dropped.append(DroppedReplica(replica_id=rid, node_id=rep.node_id, reason=reason,
                                                   last_report=rep.last_seen, dropped_at=now))
        return replica_ids

    def view(self, now: float | None = None) -> ControllerView:
        now = time.time() if now is None else now
        fits = {key: dep.latency_fits() for key, dep in self.deployments.items()}
        views = [replica_view(rid, rep, self.deployments[rep.deployment], fits[rep.deployment], now)
                 for rid, rep in self.replicas.items()]
        deployments = [deployment_view(key, dep, [r for r in self.replicas.values() if r.deployment == key])
                       for key, dep in self.deployments.items()]
        return ControllerView(
            paused=self.paused, restored_from_checkpoint=self.restored, decisions=self.decisions,
            policies_pushed=self.pushed, replicas=views, deployments=deployments, dropped=list(self.dropped))

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> ControllerCheckpoint:
        """Everything a restarted controller needs (controller.checkpoint). A snapshot: its
        lists are copies, so it can be written out in a thread while reports go on."""
        return ControllerCheckpoint(
            replicas={rid: rep.checkpoint() for rid, rep in self.replicas.items()},
            deployments={key: dep.checkpoint() for key, dep in self.deployments.items()},
            paused=self.paused, decisions=self.decisions, pushed=self.pushed)

    def load_state(self, ckpt: ControllerCheckpoint) -> None:
        """Resume from a checkpoint: its models, load estimates and policies in force."""
        replicas = {rid: Replica.restore(r, self.config.half_life_s) for rid, r in ckpt.replicas.items()}
        deployments = {key: Deployment.restore(d, self.config.half_life_s) for key, d in ckpt.deployments.items()}
        self.replicas, self.deployments = replicas, deployments  # all or nothing
        self.paused, self.decisions, self.pushed = ckpt.paused, ckpt.decisions, ckpt.pushed
        self.restored = True
