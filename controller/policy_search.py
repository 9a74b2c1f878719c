"""Policy search: the speculation config for every batch-size bucket of one replica.

For a batch of b sequences under config c, with E(c) tokens accepted per sequence per step
(acceptance model) and a step time t(b, c) (step-time model):
- goodput (accepted tokens/s) = b * E(c) / t(b, c)
- TPOT (seconds per output token) = t(b, c) / E(c)
At a fixed batch the two rank configs alike; they differ from the latency objective, which
compares whole tables at the batch the table itself causes (latency.operating_point), and
from the SLO objective (most goodput with TPOT <= SLO).

Step times for every (batch size, config) of a deployment come from one model call per
control period (`CostTable`); a replica's decision is then a few numpy operations.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from adaspec.policy import SpecConfig, SpecPolicy
from adaspec.telemetry import PolicySpeed
from controller.acceptance import best_tree, ranks_and_depths
from controller.latency import OperatingPoint, operating_point, request_latency
from controller.step_time import StepTimeModel, decode_features, monotone_table

# Trees tried before the deployment has measured any acceptance (cold start, the simulator).
TREE_SHAPES = [(2,), (2, 1), (2, 2), (3, 1), (3, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 1, 1),
               (3, 2, 1, 1), (4, 2, 2, 1), (2, 2, 2, 2), (4, 2, 1, 1, 1, 1)]
# Draft nodes per sequence the tree search may spend; each gives one candidate shape.
TREE_BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)
MAX_TREE_RANK = 4  # sibling ranks the tree search considers
DEFAULT_MAX_TREE_NODES = 32  # when the engine does not say how many it holds


# A decision stays inside the controller's process (the checkpoint leaves it out: it is
# made again on the next report), and 1,000 replicas make 1,000 a second: plain frozen
# dataclasses, not validated models (validating the buckets took 6% of a simulated fleet's time).
@dataclass(frozen=True, slots=True)
class BucketChoice:
    batch_lo: int
    batch_hi: int
    config: SpecConfig
    tokens_per_s: float  # predicted accepted tokens/s of the whole batch
    tpot_s: float  # predicted seconds per output token


@dataclass(frozen=True, slots=True)
class Decision:
    policy: SpecPolicy
    changed: bool  # differs from the policy in force
    buckets: list[BucketChoice]
    operating_batch: float  # predicted mean batch at the replica's arrival rate
    predicted_latency_s: float  # predicted mean request latency there (inf: saturated)
    elapsed_s: float  # decision time


@dataclass(frozen=True)
class Objective:
    kind: Literal["goodput", "latency", "tpot_slo"] = "goodput"
    tpot_slo_s: float | None = None


def batch_buckets(max_batch: int) -> list[tuple[int, int]]:
    """1, 2, 3-4, 5-8, ... up to max_batch: finer where the best k changes fastest."""
    buckets, lo = [(1, 1)], 2
    while lo <= max_batch:
        hi = min(2 * (lo - 1), max_batch)
        buckets.append((lo, hi))
        lo = hi + 1
    return buckets


def bucket_of(batch: int, max_batch: int) -> tuple[int, int]:
    """The bucket (lo, hi) holding `batch`; the last one for a batch beyond max_batch."""
    buckets = batch_buckets(max_batch)
    for lo, hi in buckets:
        if lo <= batch <= hi:
            return lo, hi
    return buckets[-1]


def tree_envelope(parents: list[int]) -> SpecConfig:
    """The smallest tree of the policy language (one width per depth) that holds the tree
    `parents`: at each depth, the most children any node there has."""
    ranks, depths = ranks_and_depths(parents)
    widths = [0] * max(depths, default=0)
    for rank, depth in zip(ranks, depths):
        widths[depth - 1] = max(widths[depth - 1], rank + 1)
    return SpecConfig.tree(widths)


def live_tree_configs(q: np.ndarray, max_k: int, max_nodes: int) -> list[SpecConfig]:
    """Tree candidates from measured acceptance (marginal rates per depth and sibling rank):
    for each budget of TREE_BUDGETS, the best tree of that many nodes (Sequoia's dynamic
    program, controller.acceptance.best_tree), widened to the policy language's shape; kept
    when it branches and has at most `max_nodes` nodes. Rates are rounded to 0.05: noise
    below that does not change the shapes."""
    q = np.round(np.asarray(q, dtype=float)[:max_k, :MAX_TREE_RANK] * 20) / 20
    out: list[SpecConfig] = []
    for budget in TREE_BUDGETS:
        if budget > max_nodes:
            break
        config = tree_envelope(best_tree(q, budget, max_k)[1])
        if not config.is_chain and config.num_nodes <= max_nodes and config not in out:
            out.append(config)
    return out


def candidate_configs(max_k: int, supports_trees: bool, q: np.ndarray | None = None,
                      max_tree_nodes: int | None = None) -> list[SpecConfig]:
    """off, every chain up to max_k and, for an engine that runs trees, the trees worth
    pricing: chosen from the deployment's measured acceptance `q` (live_tree_configs), or the
    fixed TREE_SHAPES before any was measured."""
    configs = [SpecConfig.off()] + [SpecConfig.chain(k) for k in range(1, max_k + 1)]
    if supports_trees and q is not None:
        configs += live_tree_configs(q, max_k, max_tree_nodes or DEFAULT_MAX_TREE_NODES)
    elif supports_trees:
        configs += [SpecConfig.tree(w) for w in TREE_SHAPES if len(w) <= max_k]
    return configs


@dataclass
class CostTable:
    """Predicted step time (seconds) for batch sizes 0..max_batch x candidate configs."""

    configs: list[SpecConfig]
    step_s: np.ndarray  # [max_batch + 1, len(configs)]; row 0 unused

    def __post_init__(self) -> None:
        self.index = {c: i for i, c in enumerate(self.configs)}  # config -> column
        self.buckets = batch_buckets(self.max_batch)
        # [bucket, batch - 1]: row i averages bucket i's batch sizes (a replica's decision
        # takes a few of these means; one matrix product each).
        self.bucket_weights = np.zeros((len(self.buckets), self.max_batch))
        for i, (lo, hi) in enumerate(self.buckets):
            self.bucket_weights[i, lo - 1: hi] = 1.0 / (hi - lo + 1)

    @classmethod
    def build(cls, model: StepTimeModel, configs: list[SpecConfig], max_batch: int,
              context_per_seq: float, prefill_per_step: float, proposal_rate: float = 1.0) -> CostTable:
        """Decode-only step times at the replica's context and prefill (tokens per step).

        A step's prompt tokens are work the prompts fix, whatever the config: charging every
        config the whole step would reward configs that take fewer steps for prefill they do
        not save (a burst's 200 prompt tokens a step made chain3 look 48% cheaper per token
        than `off`, docs/benchmarks.md). So a config is charged its decode step without
        prefill, t(b, c, 0), or where larger `off`'s plus the config's increment over `off` at
        the current prefill P, t(b, off, 0) + t(b, c, P) - t(b, off, P): verify tokens on top
        of a prompt-heavy pass can cost more (the pass is nearer the compute-bound side). Never
        less: recorded steps with many prompt tokens have few decoding sequences, so a fitted
        model's increment at a large P over all b sequences is an extrapolation (the shipped
        profile's model priced chain3 at batch 32 a quarter below `off` at 2,000 prompt
        tokens a step)."""
        priced = [*configs, SpecConfig.off()]  # the last column: `off`, the increments' base

        def table(prefill: float) -> np.ndarray:
            rows = [decode_features(b, c, context_per_seq, prefill, proposal_rate)
                    for b in range(1, max_batch + 1) for c in priced]
            return model.predict(rows).reshape(max_batch, len(priced))

        predicted = table(0.0)
        if prefill_per_step > 0:
            at_prefill = table(prefill_per_step)
            predicted = np.maximum(predicted, predicted[:, -1:] + at_prefill - at_prefill[:, -1:])
        predicted = monotone_table(predicted[:, :-1])
        return cls(configs, np.vstack([predicted[:1], predicted]))

    def scaled(self, factor: float) -> CostTable:
        """Every step time times `factor` (a replica's StepTimeScale); itself at 1."""
        return self if factor == 1.0 else CostTable(self.configs, self.step_s * factor)

    @property
    def max_batch(self) -> int:
        return self.step_s.shape[0] - 1


def _bucket_means(costs: CostTable, values: np.ndarray) -> np.ndarray:
    """Mean of values[b - 1, :] over each of the table's buckets' batch sizes: [bucket, column]."""
    return costs.bucket_weights @ values


def _table_latency(costs: CostTable, choice_of_batch: np.ndarray, expected: np.ndarray,
                   rate: float, output_tokens: float) -> OperatingPoint:
    # Each batch size's latency once (the bisection asks for a few dozen).
    columns = choice_of_batch[1:]
    batches = np.arange(1, costs.max_batch + 1)
    latencies = request_latency(costs.step_s[batches, columns], expected[columns], output_tokens).tolist()

    def latency_at(batch: float) -> float:
        return latencies[min(max(int(math.ceil(batch)), 1), costs.max_batch) - 1]

    return operating_point(rate, latency_at, costs.max_batch)


def search_policy(costs: CostTable, expected: np.ndarray, rate: float, output_tokens: float,
                  objective: Objective = Objective(), current: SpecPolicy | None = None,
                  hysteresis: float = 0.03, version: int = 0, replica_id: str | None = None) -> Decision:
    """Best config per bucket for one replica.

    expected[i]: E of costs.configs[i] from the replica's acceptance model; rate: arrivals
    (requests/s); output_tokens: mean output length (tokens); hysteresis: a bucket switches
    only if the predicted gain over the config in force exceeds this fraction."""
    start = time.perf_counter()
    step = costs.step_s[1:]  # [b - 1, config]
    batch = np.arange(1, costs.max_batch + 1, dtype=float)[:, None]
    tokens_per_s = batch * expected[None, :] / step
    tpot = step / expected[None, :]
    buckets = costs.buckets

    if objective.kind == "tpot_slo" and objective.tpot_slo_s is not None:
        # Any config within the SLO beats every config outside it; outside, the fastest wins.
        score = np.where(tpot <= objective.tpot_slo_s, tokens_per_s, -1e12 - tpot)
    else:
        score = tokens_per_s

    choice = np.zeros(costs.max_batch + 1, dtype=int)
    tps_means = _bucket_means(costs, tokens_per_s)  # [bucket, config]
    bucket_means = tps_means if score is tokens_per_s else _bucket_means(costs, score)
    best_of = bucket_means.argmax(axis=1)
    in_force = _columns(costs, current) if current is not None else None
    for i, (lo, hi) in enumerate(buckets):
        best = int(best_of[i])
        if in_force is not None:
            cur = int(in_force[lo - 1])
            if cur >= 0:
                gain = (bucket_means[i, best] - bucket_means[i, cur]) / max(abs(bucket_means[i, cur]), 1e-12)
                if gain <= hysteresis:
                    best = cur
        choice[lo: hi + 1] = best
    choice[0] = choice[1]

    point = _table_latency(costs, choice, expected, rate, output_tokens)
    if objective.kind == "latency":
        # Compare whole tables at the batch each causes: uniform ones against the per-bucket one.
        for i in range(len(costs.configs)):
            uniform = np.full_like(choice, i)
            candidate = _table_latency(costs, uniform, expected, rate, output_tokens)
            if candidate.latency_s < point.latency_s * (1 - hysteresis):
                choice, point = uniform, candidate

    out_buckets = []
    tpot_means = _bucket_means(costs, tpot)
    for i, (lo, hi) in enumerate(buckets):
        c = int(choice[lo])
        out_buckets.append(BucketChoice(lo, hi, costs.configs[c], float(tps_means[i, c]), float(tpot_means[i, c])))
    policy = SpecPolicy.from_table([costs.configs[c] for c in choice], version=version, replica_id=replica_id)
    changed = not policy.same_rules(current)
    return Decision(policy=policy, changed=changed, buckets=out_buckets,
                    operating_batch=point.batch, predicted_latency_s=point.latency_s,
                    elapsed_s=time.perf_counter() - start)


def _columns(costs: CostTable, policy: SpecPolicy) -> np.ndarray:
    """[batch - 1] -> the cost table's column of the config `policy` runs at that batch
    (policy.compile's table, one lookup per rule); -1 where the table does not hold it."""
    cols = np.full(costs.max_batch, costs.index.get(policy.rules[0].config, -1))
    for rule in policy.rules:
        if rule.batch_lo > costs.max_batch:
            break
        cols[rule.batch_lo - 1: min(rule.batch_hi, costs.max_batch)] = costs.index.get(rule.config, -1)
    return cols


def policy_speed(costs: CostTable, expected: np.ndarray, policy: SpecPolicy) -> PolicySpeed | None:
    """Predicted seconds per output token of one sequence, per batch bucket, under `policy`:
    step time t(b, c) / E(c) with c the config the policy runs at batch b (the request
    router's input). None when the policy runs a config the cost table does not hold."""
    cols = _columns(costs, policy)
    if (cols < 0).any():
        return None
    batch = np.arange(1, costs.max_batch + 1)
    tpot = (costs.step_s[batch, cols] / expected[cols])[:, None]
    means = _bucket_means(costs, tpot)[:, 0]
    # One validation of the whole value (a third faster than a model per bucket).
    return PolicySpeed.model_validate({"policy_version": policy.version, "buckets": [
        {"batch_lo": lo, "batch_hi": hi, "tpot_s": max(m, 1e-9)} for (lo, hi), m in zip(costs.buckets, means.tolist())]})
