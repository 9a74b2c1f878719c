"""A discrete-event simulation of N replicas under Poisson load, driven by fitted models and
the same `ControllerCore` the Ray actor runs (`adaspec simulate`).

Each simulated replica runs continuous batching: arrivals queue, join the running batch up
to the engine's largest batch, take one step for their prompt, then decode; every step's
duration comes from the step-time model (tabulated per batch size and config) and every
sequence's accepted draft tokens are drawn from the acceptance model's per-position rates.
Every control period each replica reports its telemetry to the controller and applies the
policy it answers. Telemetry is summarised per (batch size, config) and period: one
StepRecord per group, durations averaged, acceptance counts summed.

Each arrival is routed at its arrival time (`routing`: at random, Ray Serve's power of two
choices, or the speculation-aware router's choose_replica on the RoutingStats the replicas
measure every stats period). A replica only depends on its own arrivals, so replicas are
advanced lazily: the two power-of-two candidates to the arrival instant, every replica to
each stats tick (spec_aware only) and to the end of each control period.
"""

from __future__ import annotations

import contextlib
import functools
import gc

import math
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import (
    ROUTING_RECENT_STEPS, EngineCapabilities, PolicySpeed, ReplicaInfo, ReplicaTelemetry, RequestRecord, RoutingStats,
    StepRecord,
)
from controller.acceptance import measured_acceptance, measured_proposal_rate
from controller.config import ControllerConfig
from controller.core import ControllerCore
from controller.policy_search import CostTable, candidate_configs
from controller.routing import MAX_CANDIDATES, choose_replica, sample_candidates
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
        given_draft = list(acceptance)
        if given_draft and proposal_rate > 0:
            given_draft[0] = min(1.0, given_draft[0] / proposal_rate)
        return cls(configs, table.step_s.tolist(), step_model.prefill_s_per_token, given_draft, max_batch, max_k, model_id,
                   proposal_rate)

    @functools.cached_property
    def config_index(self) -> dict[SpecConfig, int]:
        """Each config's index in `configs` (a policy's configs are looked up at every set)."""
        return {c: i for i, c in enumerate(self.configs)}

    @property
    def info(self) -> ReplicaInfo:
        caps = EngineCapabilities(engine="vllm", max_batch_size=self.max_batch, max_k=self.max_k,
                                  supports_trees=False, draft_method="simulated")
        return ReplicaInfo(capabilities=caps, node_id="simulated", started_at=0.0)  # simulated time


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
    """One simulated replica. Its clock `t` (seconds) only moves when asked (`advance`), so a
    router can look at a few replicas at an arrival instant without stepping all of them:
    between two of its own arrivals a replica depends on nothing else."""

    def __init__(self, replica_id: str, engine: SimulatedEngine, policy: SpecPolicy, rng: random.Random,
                 output_tokens: int, prompt_tokens: int, warmup_s: float = 0.0, keep_recent: bool = False):
        """`keep_recent`: keep the records of the last ROUTING_RECENT_STEPS decode steps and
        finished requests, for `routing_stats` (they cost time, so only the spec_aware
        router asks for them)."""
        self.id, self.engine, self.rng = replica_id, engine, rng
        self.warmup_s = warmup_s
        self.output_tokens, self.prompt_tokens = output_tokens, prompt_tokens
        self.waiting: deque[float] = deque()  # arrival times, oldest first; admitted once `t` reaches them
        self.running: list[list[float]] = []  # [remaining tokens, arrival time, new (1/0)]
        self.latencies: list[float] = []
        self.set_policy(policy)
        self.speed: PolicySpeed | None = None  # the controller's last ControllerReply.speed
        self.t = 0.0
        # The step that started at `t` and ends after the time last advanced to: (config
        # index, seconds, requests admitted by it). Its batch and config are fixed when it
        # starts, as in an engine; a policy set meanwhile applies from the next step.
        self._started: tuple[int, float, int] | None = None
        self._groups: dict[tuple[int, int], _Group] = {}  # this report window's steps
        self._window_start, self._finished, self._arrivals = 0.0, 0, 0
        self.recent_steps: deque[StepRecord] | None = deque(maxlen=ROUTING_RECENT_STEPS) if keep_recent else None
        self.recent_requests: deque[RequestRecord] | None = (
            deque(maxlen=ROUTING_RECENT_STEPS) if keep_recent else None)

    def set_policy(self, policy: SpecPolicy) -> None:
        self.policy = policy
        index = self.engine.config_index
        self.lookup = [index[c] for c in policy.compile(self.engine.max_batch)]

    @property
    def ongoing(self) -> int:
        """Requests at the replica now (running and waiting): what Serve's power of two
        choices compares."""
        return len(self.running) + len(self.waiting)

    def add_arrival(self, t: float) -> None:
        """A request arriving at `t` (seconds, not before the time last advanced to)."""
        self.waiting.append(t)
        self._arrivals += 1

    def advance(self, t: float) -> None:
        """Run the steps that end by `t` (seconds). A step under way at `t` is started (its
        requests admitted, counted as running) but finishes in a later call."""
        eng = self.engine
        while True:
            if self._started is None:
                admitted = 0
                while self.waiting and self.waiting[0] <= self.t and len(self.running) < eng.max_batch:
                    self.running.append([float(self.output_tokens), self.waiting.popleft(), 1.0])
                    admitted += 1
                if not self.running:  # idle until the next arrival
                    if not self.waiting or self.waiting[0] > t:
                        self.t = max(self.t, t)
                        return
                    self.t = self.waiting[0]
                    continue
                b = len(self.running)
                ci = self.lookup[b]
                duration = eng.step_s[b][ci] + eng.prefill_s_per_token * self.prompt_tokens * admitted
                self._started = (ci, duration, admitted)
            ci, duration, admitted = self._started
            if self.t + duration > t:
                return
            self._started = None
            self._step(ci, duration, admitted)

    def _step(self, ci: int, duration: float, admitted: int) -> None:
        """Run the step that started at `t` (config index, seconds, requests it admitted)."""
        eng, rng = self.engine, self.rng
        b = len(self.running)
        k = eng.configs[ci].depth
        self.t += duration
        g = self._groups.setdefault((b, ci), _Group(drafted=[0] * k, accepted=[0] * k))
        # The group's counts before this step, to tell this step's own for its StepRecord.
        before = None
        if self.recent_steps is not None:
            before = (g.decode, g.tokens, g.drafts, g.drafted.copy(), g.accepted.copy())
        g.steps += 1
        g.seconds += duration
        g.prefill += self.prompt_tokens * admitted
        still = []
        # The hot loop of the simulator: per sequence only its random draws; the counts per
        # draft position are added once per step (a sequence drafts all k or none, and
        # accepts a prefix of them).
        draw, proposal_rate, acceptance = rng.random, eng.proposal_rate, eng.acceptance
        drafting, accepted_hist = 0, [0] * (k + 1)  # sequences that drafted; [n] -> accepted exactly n
        for seq in self.running:
            if seq[2]:  # its prompt step: the first token, no drafts to verify yet
                seq[2], gained = 0.0, 1
            else:
                accepted, drafted = 0, k if k and draw() < proposal_rate else 0
                while accepted < drafted and draw() < acceptance[accepted]:
                    accepted += 1
                if drafted:
                    drafting += 1
                    accepted_hist[accepted] += 1
                g.decode += 1
                g.tokens += 1 + drafted
                gained = 1 + accepted
            seq[0] -= gained
            if seq[0] <= 0:
                if seq[1] >= self.warmup_s:
                    self.latencies.append(self.t - seq[1])
                self._finished += 1
                if self.recent_requests is not None:
                    # mean_batch: this step's batch (the router's stats do not read it).
                    self.recent_requests.append(RequestRecord(
                        arrival_time=seq[1], finish_time=self.t, prompt_tokens=self.prompt_tokens,
                        output_tokens=self.output_tokens, mean_batch=float(b), config=eng.configs[ci]))
            else:
                still.append(seq)
        self.running = still
        if drafting:
            g.drafts += drafting
            at_least = drafting  # sequences that accepted at least i + 1 draft tokens, from i = 0
            for i in range(k):
                g.drafted[i] += drafting
                at_least -= accepted_hist[i]
                g.accepted[i] += at_least
        if before is not None and g.decode > before[0]:
            decode, tokens, drafts, drafted, accepted = before
            self.recent_steps.append(StepRecord(
                time=self.t, duration_s=duration, batch_size=b, num_decode_reqs=g.decode - decode,
                scheduled_tokens=g.tokens - tokens + self.prompt_tokens * admitted,
                prefill_tokens=self.prompt_tokens * admitted,
                context_tokens=b * (self.prompt_tokens + self.output_tokens // 2), config=eng.configs[ci],
                policy_version=self.policy.version, num_drafts=g.drafts - drafts, draft_k=k,
                drafted_per_pos=[n - m for n, m in zip(g.drafted, drafted)],
                accepted_per_pos=[n - m for n, m in zip(g.accepted, accepted)]))

    def routing_stats(self, now: float) -> RoutingStats:
        """What the real replica reports to the router at `now` (seconds; advance to it
        first): serve_app/replica.py's record_routing_stats, the same RoutingStats.measure.
        Needs keep_recent."""
        assert self.recent_steps is not None and self.recent_requests is not None, "made without keep_recent"
        speed = self.speed if self.speed is not None and self.speed.policy_version == self.policy.version else None
        return RoutingStats.measure(list(self.recent_steps), list(self.recent_requests), running=len(self.running),
                                    waiting=len(self.waiting), max_batch_size=self.engine.max_batch,
                                    measured_at=now, speed=speed)

    def report(self, t_end: float) -> ReplicaTelemetry:
        """The telemetry of the steps run since the last report, as a replica sends it at
        `t_end` (seconds; advance to it first). Telemetry is summarised per (batch size,
        config): one StepRecord per group, durations averaged, acceptance counts summed."""
        eng = self.engine
        steps = [StepRecord(
            time=t_end, duration_s=g.seconds / g.steps, batch_size=b, num_decode_reqs=g.decode // g.steps,
            scheduled_tokens=(g.tokens + g.prefill) // g.steps, prefill_tokens=g.prefill // g.steps,
            context_tokens=b * (self.prompt_tokens + self.output_tokens // 2),
            config=eng.configs[ci], policy_version=self.policy.version, num_drafts=g.drafts,
            drafted_per_pos=g.drafted, accepted_per_pos=g.accepted, draft_k=eng.configs[ci].depth)
            for (b, ci), g in self._groups.items()]
        tel = ReplicaTelemetry(
            replica_id=self.id, model_id=eng.model_id, window_start=self._window_start,
            window_end=t_end, arrivals=self._arrivals, finished=self._finished, queue_length=len(self.waiting),
            running=len(self.running), policy=self.policy, steps=steps)
        self._groups, self._window_start, self._finished, self._arrivals = {}, t_end, 0, 0
        return tel

    def run_until(self, t_end: float, arrivals: list[float]) -> ReplicaTelemetry:
        """Take `arrivals` (seconds, sorted, before `t_end`), run to `t_end` and report."""
        for a in arrivals:
            self.add_arrival(a)
        self.advance(t_end)
        return self.report(t_end)


Routing = Literal["random", "power_of_two", "spec_aware"]
ROUTINGS: tuple[Routing, ...] = get_args(Routing)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One request routed (`simulate(trace=...)`): for power of two choices, the two
    candidates and their ongoing requests at that instant, the chosen first."""

    time_s: float
    replica: int  # index of the replica it went to
    router: Routing  # the router that chose: spec_aware's fallback shows as power_of_two
    candidates: tuple[int, ...] = ()
    ongoing: tuple[int, ...] = ()


class SimulationResult(BaseModel):
    replicas: int
    routing: Routing
    simulated_s: float
    wall_s: float
    cpu_s: float  # this process's CPU seconds: a speed that other processes on the machine do not slow
    speed: float  # simulated seconds per wall second
    rate: float  # requests/s over all replicas
    arrivals: int  # requests that arrived (the same for every router at one seed)
    completed: int
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    fallback_routes: int  # spec_aware requests routed by power of two choices (stats could not tell)
    final_policies: dict[str, int]  # policy text -> replicas running it at the end
    controller_decisions: int


# As the app's (serve_app/builder.py): Serve asks the replicas for stats every 0.5 s and the
# router takes stats up to 4 periods old.
ROUTING_STATS_PERIOD_S = 0.5
STATS_AGE_PERIODS = 4
# Allocations between young collections during a run (Python's default: 700).
GC_FIRST_GENERATION_THRESHOLD = 50_000


class _Router:
    """Picks the replica of each arrival, at its arrival time, with the replicas' state then."""

    def __init__(self, routing: Routing, sims: list[SimReplica], rng: random.Random, stats_period_s: float,
                 output_tokens: int, trace: list[RouteDecision] | None):
        self.routing, self.sims, self.rng, self.trace = routing, sims, rng, trace
        self.stats_period_s, self.output_tokens = stats_period_s, output_tokens
        self.next_stats = 0.0  # the first stats are taken at 0 s (no step measured yet: fallback)
        self.tick = 0.0  # when the stats in force were taken (seconds)
        self.stats: dict[int, RoutingStats] = {}  # replica -> its stats at `tick`, measured when first read
        self.sent: dict[int, int] = {}  # requests routed to each replica since its stats were taken
        self.fallbacks = 0

    def route(self, t: float, uniform_pick: int) -> int:
        """The replica of a request arriving at `t` (seconds); `uniform_pick` is the random
        router's. A replica always takes the request: Serve's max_ongoing_requests is not
        simulated, so the live router's first ranked replica is the one."""
        if self.routing == "random":
            return self._log(t, uniform_pick, "random")
        if self.routing == "spec_aware":
            if t >= self.next_stats:
                self._refresh(t)
            picked = sample_candidates(range(len(self.sims)), MAX_CANDIDATES, self.rng)
            candidates = [(i, self._stats_of(i)) for i in picked]
            chosen = choose_replica(candidates, t, STATS_AGE_PERIODS * self.stats_period_s,
                                    output_tokens=self.output_tokens, load_change=self.sent, rng=self.rng)
            if chosen is not None:
                self.sent[chosen] = self.sent.get(chosen, 0) + 1
                return self._log(t, chosen, "spec_aware")
            self.fallbacks += 1
        chosen = self._power_of_two(t)
        self.sent[chosen] = self.sent.get(chosen, 0) + 1  # the live router counts its fallbacks' too
        return chosen

    def _refresh(self, t: float) -> None:
        # Only the latest tick at or before t matters: stats taken at earlier ticks would be
        # replaced before any request read them.
        tick = self.next_stats + math.floor((t - self.next_stats) / self.stats_period_s) * self.stats_period_s
        self.tick, self.stats, self.sent = tick, {}, {}
        self.next_stats = tick + self.stats_period_s

    def _stats_of(self, i: int) -> RoutingStats:
        """Replica i's stats as Serve would have taken them at the tick. Measured only when a
        request first samples the replica: no replica moves past the tick before then (the
        control period ends after the tick's arrivals; power of two reads its two first)."""
        stats = self.stats.get(i)
        if stats is None:
            self.sims[i].advance(self.tick)
            stats = self.stats[i] = self.sims[i].routing_stats(self.tick)
        return stats

    def _power_of_two(self, t: float) -> int:
        """Ray Serve's PowerOfTwoChoicesRequestRouter: two distinct replicas at random, the
        one with fewer ongoing requests, the first drawn on a tie."""
        n = len(self.sims)
        if n == 1:
            return self._log(t, 0, "power_of_two")
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        j += j >= i
        a, b = self.sims[i], self.sims[j]
        if self.routing == "spec_aware" and self.next_stats > 0:
            for k in (i, j):  # their stats at the tick, measured before they move on
                self._stats_of(k)
        a.advance(t)
        b.advance(t)
        chosen = i if a.ongoing <= b.ongoing else j
        if self.trace is not None:
            first, second = (i, j) if chosen == i else (j, i)
            self.trace.append(RouteDecision(t, chosen, "power_of_two", (first, second),
                                            (self.sims[first].ongoing, self.sims[second].ongoing)))
        return chosen

    def _log(self, t: float, chosen: int, router: Routing) -> int:
        if self.trace is not None:
            self.trace.append(RouteDecision(t, chosen, router))
        return chosen


@contextlib.contextmanager
def _rare_collections(first_generation: int = GC_FIRST_GENERATION_THRESHOLD):
    """Python's cyclic collector runs rarely inside: a fleet holds ~10^6 live records
    (replicas' windows, requests, routing stats) that every full collection rescans, and the
    default (a young collection every 700 allocations) spent a quarter of a 1,000-replica run
    there. Nothing here builds cycles that must go early; reference counting frees the rest."""
    before = gc.get_threshold()
    gc.set_threshold(first_generation, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def simulate(engine: SimulatedEngine, replicas: int, duration_s: float, rate: float,
             controller: ControllerConfig | None = None, policy: str = "chain2", seed: int = 0,
             output_tokens: int = 128, prompt_tokens: int = 200, period_s: float = 1.0,
             warmup_s: float = 0.0, routing: Routing = "random",
             routing_stats_period_s: float = ROUTING_STATS_PERIOD_S,
             replica_acceptance: Sequence[float] | None = None,
             trace: list[RouteDecision] | None = None) -> SimulationResult:
    """Simulate `replicas` replicas sharing Poisson arrivals at `rate` requests/s; with
    `controller`, every replica reports every `period_s` seconds and follows it, else all run
    the static `policy`. Latencies of requests that arrived before `warmup_s` are left out.

    `routing` picks each request's replica at its arrival time: `random` (uniformly),
    `power_of_two` (Ray Serve's default: the one of two random replicas with fewer ongoing
    requests then) or `spec_aware` (controller/routing.py's choose_replica, as
    serve_app/router.py, on RoutingStats the replicas measure every `routing_stats_period_s`
    seconds; power of two when the stats cannot tell). The arrival times depend on `seed`
    only, not on the router.

    `replica_acceptance`: a fleet whose drafters differ: replica i accepts each draft
    position at rate `replica_acceptance[i % len]` (given a draft) instead of the engine's.
    `trace`: a list that gets every routing decision (RouteDecision)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
    rng = random.Random(seed)
    core = ControllerCore(controller) if controller is not None else None
    start_policy = SpecPolicy.parse(policy)
    engines = [engine] * replicas
    if replica_acceptance:
        # The same engine with another drafter: only the acceptance differs.
        variants = [replace(engine, acceptance=[rate] * len(engine.acceptance)) for rate in replica_acceptance]
        engines = [variants[i % len(variants)] for i in range(replicas)]
    sims = [SimReplica(f"r{i}", engines[i], start_policy, random.Random(seed * 7919 + i), output_tokens,
                       prompt_tokens, warmup_s, keep_recent=routing == "spec_aware") for i in range(replicas)]
    router = _Router(routing, sims, random.Random(seed * 104729 + 1), routing_stats_period_s, output_tokens, trace)
    eng_info = engine.info
    next_arrival = rng.expovariate(rate) if rate > 0 else float("inf")
    wall, cpu = time.perf_counter(), time.process_time()
    t, last_refit, arrivals = 0.0, -1e18, 0
    with _rare_collections():
        while t < duration_s - 1e-9:
            t_end = min(t + period_s, duration_s)
            while next_arrival < t_end:
                # Every router draws the random router's pick, so that the arrival times (the
                # same generator) do not depend on the router.
                pick = rng.randrange(replicas)
                sims[router.route(next_arrival, pick)].add_arrival(next_arrival)
                arrivals += 1
                next_arrival += rng.expovariate(rate)
            for sim in sims:
                sim.advance(t_end)
                tel = sim.report(t_end)
                if core is not None:
                    reply = core.report(tel, now=t_end)
                    if reply.send_info:  # its first report (as a real replica, it waits to be asked)
                        reply = core.report(tel.model_copy(update={"info": eng_info}), now=t_end)
                    if reply.policy is not None:
                        sim.set_policy(reply.policy)
                    sim.speed = reply.speed
            if core is not None:
                core.drop_stale(t_end)
                if t_end - last_refit >= controller.refit_every_s:
                    core.refit()
                    last_refit = t_end
            t = t_end
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    latencies = sorted(lat for s in sims for lat in s.latencies)
    latencies = latencies or [float("nan")]
    finals: dict[str, int] = {}
    for s in sims:
        finals[str(s.policy)] = finals.get(str(s.policy), 0) + 1
    return SimulationResult(
        replicas=replicas, routing=routing, simulated_s=duration_s, wall_s=wall, cpu_s=cpu,
        speed=duration_s / wall, rate=rate, arrivals=arrivals,
        completed=len(latencies), mean_latency_s=statistics.fmean(latencies),
        p50_latency_s=latencies[len(latencies) // 2], p99_latency_s=latencies[int(0.99 * (len(latencies) - 1))],
        fallback_routes=router.fallbacks,
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
    key, dep = next(iter(core.deployments.items()))
    model_id = dep.model_id
    reps = [r for r in core.replicas.values() if r.deployment == key]
    caps = reps[0].capabilities if reps else None
    max_batch = max_batch or (caps.max_batch_size if caps else 64)
    max_k = max_k or (caps.max_k if caps else 4)
    acceptance = reps[0].acceptance if reps else dep.acceptance
    rates = acceptance.conditional_rates()[:max_k, 0].tolist()
    return SimulatedEngine.from_models(dep.step_model, rates, max_batch, max_k,
                                       dep.context_per_seq or 300.0, model_id, dep.proposal_rate)

