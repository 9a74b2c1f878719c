"""The speculation-aware request router of the replica deployment (`routing: spec_aware`).

Ray Serve runs one router per DeploymentHandle of the replica deployment, i.e. inside the
ingress replica(s), whose OpenAI routes call the replicas through a handle. Every
`request_routing_stats_period_s` Serve's controller calls each replica's
`record_routing_stats` (serve_app/replica.py: a `RoutingStats` under its key) and broadcasts
the dicts to every handle, where they appear as `RunningReplica.routing_stats`.

For each request `choose_replicas` ranks the candidates Serve gives it (live replicas only;
a random `max_candidates` of them in a larger fleet) by predicted completion time
(controller/routing.py: the replica's load as its stats measured it, plus the requests this
router sent there and less those it saw finish there since; its measurements and the
controller's predicted speed under its policy), best first, one replica per rank: Serve
sends the request to the first that accepts it (below its max_ongoing_requests). When any
ranked candidate's stats are missing or stale, or none can predict yet, it falls back to
Serve's own power-of-two choices for that request (the base class). Each choice is counted
by mode (`ray_adaspec_router_choices_total{mode="spec_aware"|"power_of_two"}`), tagged with
the deployment routed to, as Serve's own router metrics are.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from typing import Any

from adaspec.telemetry import RoutingStats
from controller.routing import (
    DEFAULT_OUTPUT_TOKENS, FIXED_STEP_SHARE, MAX_CANDIDATES, TIE_TOLERANCE, rank_replicas, sample_candidates,
)
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica
from ray.util import metrics
from serve_app.ray_llm import PowerOfTwoChoicesRequestRouter

logger = logging.getLogger("ray.serve")

# Stats older than this (seconds) are stale; the builder sets it from the stats period.
DEFAULT_MAX_STATS_AGE_S = 2.0


def request_output_tokens(pending_request: PendingRequest | None) -> int:
    """The output tokens a request asks for (max_tokens, or max_completion_tokens for chat),
    DEFAULT_OUTPUT_TOKENS when it does not say."""
    body = pending_request.args[0] if pending_request is not None and pending_request.args else None
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_OUTPUT_TOKENS


class SpecAwareRouter(PowerOfTwoChoicesRequestRouter):
    """Least predicted completion time, from the replicas' RoutingStats; Serve's
    power-of-two choices when the stats cannot tell."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, max_stats_age_s: float = DEFAULT_MAX_STATS_AGE_S,
                         fixed_step_share: float = FIXED_STEP_SHARE, tie_tolerance: float = TIE_TOLERANCE,
                         max_candidates: int = MAX_CANDIDATES, **kwargs: Any) -> None:
        """Serve calls this with RequestRouterConfig.request_router_kwargs (seconds; shares;
        replicas scored per request)."""
        super().initialize_state(**kwargs)
        self._max_stats_age_s = max_stats_age_s
        self._max_candidates = max_candidates
        self._fixed_step_share = fixed_step_share
        self._tie_tolerance = tie_tolerance
        self._rng = random.Random()
        # Unix seconds of the requests sent to, and finished on, each replica lately: the stats
        # lag by up to a period; without the sends a burst would all go to the replica that
        # was best then, and without the finishes a replica would look busy with a request
        # that has just ended (one client sending its requests one after another would see
        # every other one sent elsewhere).
        self._sent: dict[ReplicaID, deque[float]] = {}
        self._finished: dict[ReplicaID, deque[float]] = {}
        self._spec_aware: bool | None = None  # the mode of the last choice, to log changes only
        self._choices = metrics.Counter(
            "adaspec_router_choices", "replica choices made, by mode: spec_aware (ranked by predicted "
            "completion time) or power_of_two (Serve's own, when the replicas' stats cannot tell)",
            tag_keys=("application", "deployment", "mode"))
        self._choices.set_default_tags({"application": self._deployment_id.app_name,
                                        "deployment": self._deployment_id.name})

    # ------------------------------------------------------------------ routing
    def rank(self, candidate_replicas: list[RunningReplica],
             pending_request: PendingRequest | None = None) -> list[RunningReplica] | None:
        """The candidates (a random `max_candidates` of them) best first, or None when their
        stats cannot tell."""
        now = self._get_curr_time_s()
        candidate_replicas = sample_candidates(candidate_replicas, self._max_candidates, self._rng)
        candidates = [(r.replica_id, RoutingStats.from_routing_stats(r.routing_stats)) for r in candidate_replicas]
        finished = {rid: self._count_since(self._finished, rid, s.measured_at) for rid, s in candidates if s is not None}
        change = {rid: self._count_since(self._sent, rid, s.measured_at) - finished[rid]
                  for rid, s in candidates if s is not None}
        ranked = rank_replicas(candidates, now, self._max_stats_age_s,
                               output_tokens=request_output_tokens(pending_request), load_change=change,
                               finished=finished,
                               fixed_share=self._fixed_step_share, tie_tolerance=self._tie_tolerance, rng=self._rng)
        if ranked is None:
            return None
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [by_id[rid] for rid in ranked]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranked = self.rank(candidate_replicas, pending_request) if candidate_replicas else None
        self._log_mode(ranked is not None)
        self._choices.inc(1, tags={"mode": "spec_aware" if ranked is not None else "power_of_two"})
        if ranked is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        if pending_request is not None:
            # Every candidate is ranked: if all of them are full, Serve must back off before
            # asking again (it does not when a locality pass is still to come).
            pending_request.routing_context.should_backoff = True
        return [[r] for r in ranked]

    def _log_mode(self, spec_aware: bool) -> None:
        if spec_aware != self._spec_aware:
            logger.info("adaspec router: %s", "speculation-aware" if spec_aware
                        else "power of two choices (replica routing stats missing or stale)")
            self._spec_aware = spec_aware

    @staticmethod
    def _count_since(times: dict[ReplicaID, deque[float]], replica_id: ReplicaID, since: float) -> int:
        return sum(1 for t in times.get(replica_id, ()) if t > since)

    def _record(self, times: dict[ReplicaID, deque[float]], replica_id: ReplicaID) -> None:
        now = self._get_curr_time_s()
        recent = times.setdefault(replica_id, deque())
        recent.append(now)
        while recent and recent[0] < now - self._max_stats_age_s:  # older ones precede any fresh stats
            recent.popleft()

    # ------------------------------------------------------------------ Serve's callbacks
    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._record(self._sent, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve calls this once per request sent (finished, failed, cancelled or refused by
        the replica, whose send was counted too)."""
        super().on_request_completed(replica_id, internal_request_id)
        self._record(self._finished, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)
        self._finished.pop(replica_id, None)
