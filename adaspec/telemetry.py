"""Telemetry: what a replica measures and sends up to the controller and the operator.

- `StepRecord`: one engine step. Built in the engine's hot loop, so it is a plain slotted
  dataclass (cheap to create); pydantic validates it when a `ReplicaTelemetry` is parsed.
- `ReplicaTelemetry`: a replica's window of steps plus its load (arrivals, queue).

Acceptance terms (Leviathan et al. 2023; vLLM's spec-decode metrics):
- drafted[i]: sequences in the step that had a draft token at position i (0-based).
- accepted[i]: sequences whose draft token at position i was accepted (so were 0..i-1).
- conditional acceptance at position i: accepted[i] / accepted[i-1] (accepted[-1] = drafts).
- accepted length: tokens a sequence gains per verify step, the bonus token included,
  i.e. 1 + accepted draft tokens.
"""

from __future__ import annotations

import bisect
import functools
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from adaspec.policy import SpecConfig, SpecPolicy


@dataclass(slots=True)
class StepRecord:
    """One engine step (schedule + forward + verify), as measured inside the engine."""

    time: float  # unix seconds at the end of the step
    duration_s: float  # seconds from schedule() (or the previous step's end, if later) to the processed output
    batch_size: int  # requests scheduled in the step (prefill and decode)
    num_decode_reqs: int  # of those, requests decoding (verifying drafts or not)
    scheduled_tokens: int  # tokens run through the target model
    prefill_tokens: int  # of those, prompt tokens
    context_tokens: int  # KV tokens the scheduled requests held before the step
    config: SpecConfig  # in force for this batch size (decides the next drafts)
    policy_version: int
    num_drafts: int = 0  # sequences that verified draft tokens in this step
    # Draft tokens per sequence the drafter was asked for, for this step's verification (the
    # previous step's k). A decoding sequence with no draft (n-gram lookup found no match)
    # then counts as rejected at the first position.
    draft_k: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)  # [position] -> sequences
    accepted_per_pos: list[int] = field(default_factory=list)  # [position] -> sequences
    # Trees (native engine): [depth][sibling rank] -> sequences that had that candidate with
    # its parent accepted and every lower-ranked sibling rejected, and how many accepted it.
    reached_per_depth_rank: list[list[int]] = field(default_factory=list)
    accepted_per_depth_rank: list[list[int]] = field(default_factory=list)
    # Per decoding sequence (native engine), in the step's order: draft nodes verified and
    # draft tokens accepted. Under per-request budgets they differ from sequence to sequence.
    nodes_per_seq: list[int] = field(default_factory=list)
    accepted_per_seq: list[int] = field(default_factory=list)
    node_budget: int | None = None  # per-request budgets: draft nodes the engine kept (B); else None
    # Shadow acceptance: drafts the drafter WOULD have made at each step for every k up to
    # max_k, scored against the tokens the target produced, whatever k ran (`off` included),
    # in the per-position terms above. Counted in the step whose output settled them (up to
    # max_k steps after the draft). `shadow_source` says how they were made: "" none,
    # "ngram-replay" (vLLM's n-gram matching replayed on each request's history,
    # serve_app/ngram_shadow.py: exact for greedy requests, an estimate for sampled ones).
    shadow_source: str = ""
    shadow_seqs: int = 0  # shadow drafts settled: sequences the drafter was asked for, drafted or not
    shadow_drafted_per_pos: list[int] = field(default_factory=list)  # [position] -> sequences
    shadow_accepted_per_pos: list[int] = field(default_factory=list)  # [position] -> sequences
    # Seconds of adaspec's own work in the engine's thread since the previous record: the
    # scheduler hooks (recording, shadow drafting) and the telemetry drains between steps.
    # The engine without adaspec would have spent that much less (0: not measured).
    overhead_s: float = 0.0


@dataclass(slots=True)
class RequestRecord:
    """One finished request, as the engine saw it (its latency includes queueing)."""

    arrival_time: float  # unix seconds the engine received it
    finish_time: float  # unix seconds it finished
    prompt_tokens: int
    output_tokens: int
    mean_batch: float  # mean batch size (requests) of the steps that ran it
    config: SpecConfig  # the config that ran most of its steps

    @property
    def latency_s(self) -> float:
        return self.finish_time - self.arrival_time


class RequestLifetimes:
    """Per running request, the batch sizes and configs of the steps that ran it, so that a
    finished request can say which config governed it. Both engines keep one; the
    controller fits request latency per config from the records (controller/latency.py)."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[int, int, dict[SpecConfig, int]]] = {}  # id -> batch sum, steps, config steps

    def step(self, request_ids, batch_size: int, config: SpecConfig) -> None:
        for rid in request_ids:
            batch_sum, steps, configs = self._open.get(rid, (0, 0, {}))
            configs[config] = configs.get(config, 0) + 1
            self._open[rid] = (batch_sum + batch_size, steps + 1, configs)

    def finish(self, request_id: str, arrival_time: float, prompt_tokens: int, output_tokens: int,
               finish_time: float | None = None) -> RequestRecord | None:
        """The record of a request that completed (None if no step ran it)."""
        entry = self._open.pop(request_id, None)
        if entry is None:
            return None
        batch_sum, steps, configs = entry
        return RequestRecord(arrival_time=arrival_time, finish_time=time.time() if finish_time is None else finish_time,
                             prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                             mean_batch=batch_sum / steps, config=max(configs, key=configs.get))

    def discard(self, request_id: str) -> None:
        """Forget an aborted request: its latency says nothing about the engine."""
        self._open.pop(request_id, None)


class EngineCapabilities(BaseModel):
    """What policies an engine can run; a policy is validated against this."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["vllm", "native"]
    max_batch_size: int = Field(description="largest batch the engine schedules (requests)")
    max_k: int = Field(description="deepest speculation the engine was started for (tokens)")
    supports_trees: bool
    supports_budgets: bool = Field(default=False, description="runs per-request budgets (auto, budgetN)")
    draft_method: str = Field(description="ngram | draft_model | ...")
    max_tree_nodes: int | None = Field(default=None, ge=1, description="most draft nodes per sequence per step "
                                                                      "the engine holds (trees); None: not said")
    accelerator: str = Field(default="cpu", description="what the engine runs on: 'cpu' or the GPU's name, with "
                             "' xN' for N devices (tensor parallel); step times are this hardware's")

    def deployment_key(self, model_id: str) -> str:
        """What the controller keeps one step-time model and one pooled acceptance for: a
        model on one engine and accelerator (a native and a vLLM replica of one model, or
        the same model on two kinds of GPU, step at different speeds)."""
        return f"{model_id} ({self.engine}, {self.accelerator})"


class ReplicaInfo(BaseModel):
    """What stays fixed while a replica runs. It rides on the replica's first report to a
    controller, and again whenever a controller answers `send_info` (it restarted without
    a checkpoint, or dropped the replica as silent): not on every report."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    capabilities: EngineCapabilities
    node_id: str = Field(description="the Ray node the replica runs on (hex id)")
    node_ip: str = Field(default="", description="that node's address")
    actor_id: str = Field(default="", description="the replica's Ray actor (hex id), to ask Ray whether it died")
    started_at: float = Field(description="when the replica's engine was ready (unix seconds)")


class ReplicaTelemetry(BaseModel):
    """A replica's report for one window [window_start, window_end] (unix seconds)."""

    model_config = ConfigDict(extra="forbid")

    replica_id: str
    model_id: str
    info: ReplicaInfo | None = Field(default=None, description="sent once per controller (ReplicaInfo)")
    window_start: float
    window_end: float
    arrivals: int = Field(description="requests accepted by the replica in the window")
    finished: int = Field(description="requests completed in the window")
    queue_length: int = Field(description="requests waiting for the engine now")
    running: int = Field(description="requests in the engine's running batch now")
    policy: SpecPolicy
    steps: list[StepRecord]
    requests: list[RequestRecord] = Field(default_factory=list, description="requests finished in the window")

    @property
    def arrival_rate(self) -> float:
        """Requests per second over the window."""
        span = max(self.window_end - self.window_start, 1e-9)
        return self.arrivals / span


class SpeedBucket(BaseModel):
    """Predicted decode speed of one sequence at batch sizes batch_lo..batch_hi."""

    model_config = ConfigDict(extra="forbid")

    batch_lo: int = Field(ge=1)
    batch_hi: int = Field(ge=1)
    tpot_s: float = Field(gt=0, description="seconds per output token of one sequence in such a batch")


class PolicySpeed(BaseModel):
    """The controller's prediction of how fast a replica decodes under one policy, per batch
    bucket: its deployment's step-time model and the replica's own acceptance model, with the
    config the policy runs at each batch size. The request router reads it (RoutingStats.speed)
    to predict how soon a request would finish at a batch the replica is not running now."""

    model_config = ConfigDict(extra="forbid")

    policy_version: int = Field(description="the policy these predictions are for")
    buckets: list[SpeedBucket] = Field(min_length=1, description="ascending, covering 1..max batch")

    def tpot_s(self, batch: float) -> float:
        """Predicted seconds per output token at `batch` requests (the last bucket beyond it)."""
        bounds, tpots = self._lookup
        return tpots[min(bisect.bisect_left(bounds, max(batch, 1.0)), len(tpots) - 1)]

    @functools.cached_property
    def _lookup(self) -> tuple[list[float], list[float]]:
        # The router reads a replica's speed a few times per candidate per request: a
        # bisection over the buckets' upper bounds (+0.5: a mean batch rounds to its bucket).
        return [b.batch_hi + 0.5 for b in self.buckets], [b.tpot_s for b in self.buckets]


class ControllerReply(BaseModel):
    """The controller's answer to a report."""

    model_config = ConfigDict(extra="forbid")

    policy: SpecPolicy | None = Field(default=None, description="apply this now; None: keep the one in force")
    send_info: bool = Field(default=False, description="the controller does not know this replica: "
                            "report again with `info`")
    speed: PolicySpeed | None = Field(
        default=None, description="predicted speed under `policy`, or under the policy in force when `policy` is None")


class AcceptanceSummary(BaseModel):
    """Acceptance over a set of steps (plain counts, no decay)."""

    num_drafts: int
    drafted_per_pos: list[int]
    accepted_per_pos: list[int]

    @property
    def conditional_rate_per_pos(self) -> list[float]:
        """P(accept position i | positions < i accepted), per position."""
        rates, prev = [], self.num_drafts
        for acc in self.accepted_per_pos:
            rates.append(acc / prev if prev else 0.0)
            prev = acc
        return rates

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        drafted = sum(self.drafted_per_pos)
        return sum(self.accepted_per_pos) / drafted if drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per sequence per verify step, bonus token included."""
        return 1.0 + sum(self.accepted_per_pos) / self.num_drafts if self.num_drafts else 1.0


def _add_into(total: list[int], counts: list[int]) -> None:
    if len(total) < len(counts):
        total.extend([0] * (len(counts) - len(total)))
    for i, c in enumerate(counts):
        total[i] += c


def summarize_acceptance(steps: list[StepRecord]) -> AcceptanceSummary:
    drafted: list[int] = []
    accepted: list[int] = []
    drafts = 0
    for s in steps:
        drafts += s.num_drafts
        _add_into(drafted, s.drafted_per_pos)
        _add_into(accepted, s.accepted_per_pos)
    accepted.extend([0] * (len(drafted) - len(accepted)))
    return AcceptanceSummary(num_drafts=drafts, drafted_per_pos=drafted, accepted_per_pos=accepted)


def decode_tokens_per_s(steps: list[StepRecord]) -> float:
    """Tokens gained per second of step time over the steps without prefill: (sequences
    decoded + draft tokens accepted) / step seconds; 0.0 when there are none."""
    decode = [s for s in steps if not s.prefill_tokens]
    seconds = sum(s.duration_s for s in decode)
    return sum(s.num_decode_reqs + sum(s.accepted_per_pos) for s in decode) / seconds if seconds else 0.0


def tokens_per_sequence_step(steps: list[StepRecord]) -> float:
    """Tokens a sequence gains per decode step over `steps` (1 + draft tokens accepted, per
    sequence decoded): what the drafter achieves, whatever the steps cost; 1.0 with none."""
    seqs = sum(s.num_decode_reqs for s in steps)
    return (seqs + sum(sum(s.accepted_per_pos) for s in steps)) / seqs if seqs else 1.0


_STEP = TypeAdapter(StepRecord)


def step_as_dict(step: StepRecord) -> dict:
    """A StepRecord as plain JSON values (its config as text), for files and tables."""
    return _STEP.dump_python(step, mode="json")


class ProfiledStep(BaseModel):
    """One line of a profile file (JSON lines, written by `adaspec profile`): a step and the
    model it ran."""

    model_config = ConfigDict(extra="forbid")

    model_id: str
    step: StepRecord


def read_profile(path: str, model_id: str | None = None) -> tuple[str, list[StepRecord]]:
    """(model id, its steps) from a profile file: `model_id`'s steps, or the first line's
    model's when None. Raises ValueError for a file with no steps of that model."""
    with open(path) as f:
        rows = [ProfiledStep.model_validate_json(line) for line in f if line.strip()]
    if model_id is None and rows:
        model_id = rows[0].model_id
    steps = [r.step for r in rows if r.model_id == model_id]
    if not steps:
        raise ValueError(f"{path}: no profiled steps" + (f" of {model_id}" if model_id else ""))
    return model_id, steps


# ----------------------------------------------------------------------------- routing

ROUTING_STATS_KEY = "adaspec"  # adaspec's entry in the dict a replica gives Serve's request router
ROUTING_RECENT_STEPS = 32  # decode steps a RoutingStats measures over (about 1-5 s under load)
# Steps older than this (seconds) no longer describe the replica: without the cutoff a replica
# whose last steps were slow (a warm-up compile, a burst) looks slow to the router for ever,
# gets no request, and so never measures again.
ROUTING_MAX_STEP_AGE_S = 20.0


class RoutingStats(BaseModel):
    """What a replica reports to the request router (Ray Serve's `record_routing_stats`), for
    predicting how soon a new request would finish there (controller/routing.py).

    Serve carries routing stats as a plain dict, so this crosses the boundary as
    `{ROUTING_STATS_KEY: model_dump()}` next to whatever else the replica reports (Ray Serve
    LLM's own KV-event endpoints), and is parsed back with `from_routing_stats`."""

    model_config = ConfigDict(extra="forbid")

    running: int = Field(ge=0, description="requests in the engine's running batch")
    waiting: int = Field(ge=0, description="requests queued in the engine for a batch slot")
    max_batch_size: int = Field(ge=1, description="largest batch the engine runs (requests)")
    step_s: float | None = Field(
        default=None, gt=0, description="mean seconds per decode step over the recent steps; None before any")
    step_batch: float | None = Field(
        default=None, gt=0, description="mean batch size (requests) of the steps step_s was measured over")
    tokens_per_step: float = Field(
        default=1.0, ge=1.0,
        description="output tokens per sequence per decode step over the recent steps: 1 + mean accepted "
        "draft tokens (1.0 without speculation)")
    mean_output_tokens: float | None = Field(
        default=None, gt=0, description="mean output tokens of recently finished requests; None before any")
    measured_at: float = Field(description="unix seconds of the engine load above")
    speed: PolicySpeed | None = Field(
        default=None, description="the controller's predicted speed under the policy in force; None without a "
        "controller, or before it has answered for this policy")

    @classmethod
    def measure(cls, steps: list[StepRecord], requests: list[RequestRecord], *, running: int, waiting: int,
                max_batch_size: int, measured_at: float, speed: PolicySpeed | None = None,
                recent: int = ROUTING_RECENT_STEPS, max_step_age_s: float = ROUTING_MAX_STEP_AGE_S) -> RoutingStats:
        """The stats of a replica from its step and finished-request records (oldest first),
        over the last `recent` decode steps that ended at most `max_step_age_s` seconds before
        `measured_at`, and the last `recent` requests. Prefill-only steps are left out: they
        say nothing about how fast a sequence decodes."""
        decode = [s for s in steps if s.num_decode_reqs and s.time >= measured_at - max_step_age_s][-recent:]
        done = requests[-recent:]
        return cls(
            running=running, waiting=waiting, max_batch_size=max_batch_size, measured_at=measured_at, speed=speed,
            step_s=sum(s.duration_s for s in decode) / len(decode) if decode else None,
            step_batch=sum(s.batch_size for s in decode) / len(decode) if decode else None,
            tokens_per_step=tokens_per_sequence_step(decode),
            mean_output_tokens=(sum(r.output_tokens for r in done) / len(done)
                                if done and any(r.output_tokens for r in done) else None),
        )

    def to_routing_stats(self) -> dict:
        """The entry a replica merges into the dict it returns to Serve."""
        return {ROUTING_STATS_KEY: self.model_dump(mode="json")}

    @classmethod
    def from_routing_stats(cls, stats: object) -> RoutingStats | None:
        """adaspec's stats out of a replica's Serve routing stats; None when they are missing
        or not valid (an older replica, a replica still starting), so the router falls back."""
        if not isinstance(stats, dict):
            return None
        try:
            return cls.model_validate(stats.get(ROUTING_STATS_KEY))
        except ValueError:  # pydantic's ValidationError is one
            return None
