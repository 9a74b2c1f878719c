"""Acceptance model: how many draft tokens the target accepts, for any chain or tree shape.

Terms (Leviathan et al. 2023; Sequoia, Chen et al. 2024; docs/papers.md sections 1 and 3)
- A draft tree's node v sits at depth d (1 = first draft token) with sibling rank r (0 = the
  drafter's most likely candidate among its siblings). A chain is a tree of width 1.
- Conditional rate p[d][r]: P(candidate (d, r) accepted | its parent accepted and every
  lower-ranked sibling rejected). This is what telemetry measures directly.
- Marginal rate q[d][r] = p[d][r] * prod_{r' < r} (1 - p[d][r']): P(the accepted child of a
  parent at depth d-1 is its rank-r child). A node's probability of being accepted is the
  product of q along its path: P(v) = prod q[depth(u)][rank(u)] over u on root -> v.
- Expected accepted length (tokens per sequence per verify step, bonus token included):
  E = 1 + sum over nodes v of P(v). For a chain: E = 1 + sum_i prod_{j <= i} p_j, which for
  i.i.d. acceptance alpha is the closed form (1 - alpha^(k+1)) / (1 - alpha).

The model keeps exponentially decayed counts (half-life in seconds). Decay stops at
`min_evidence` first-position candidates: when no new evidence arrives, the model keeps its
last beliefs instead of sliding back to the prior (the controller probes explicitly, see
controller.core). Decay alone would take several half-lives to show a change of workload (8
streams of text drafted badly leave a thousand candidates behind that one stream of a looping
prompt outweighs only after a minute), so each report is also tested against the counts: where
its first-position rate differs from theirs by at least `change_gap` and by `change_z` standard
errors (a two-proportion z-test), the requests that run now are not those the counts came from,
and the counts restart from this report.

Shadow acceptance (StepRecord.shadow_*: an n-gram drafter's drafts replayed on the produced
tokens for every k up to max_k, serve_app/ngram_shadow.py) feeds the same counts, at the
positions the step did not verify: all of them while `off` runs, those past the k in force
otherwise. So the model keeps learning every chain's acceptance while speculation is off.
Where a step verified drafts, its own counts stand (exact, and from the drafts that ran).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from adaspec.policy import SpecConfig
from adaspec.telemetry import StepRecord

MAX_DEPTH = 16
MAX_RANK = 8


@dataclass
class AcceptanceModel:
    """Decayed acceptance counts per (depth, sibling rank) for one replica."""

    half_life_s: float = 30.0
    prior_rate: float = 0.3  # conditional rate assumed where nothing was measured
    prior_weight: float = 2.0  # the prior counts as this many observed candidates
    min_evidence: float = 8.0  # decay stops when this few first-position candidates remain
    change_gap: float = 0.15  # a report's first-position rate this far from the counts' ...
    change_z: float = 4.0  # ... and this many standard errors from it: the workload changed
    changes: int = 0  # reports that restarted the counts
    reached: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_RANK)))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, MAX_RANK)))
    last_time: float | None = None  # unix seconds the counts are decayed to

    def decay_to(self, now: float) -> None:
        if self.last_time is not None and now > self.last_time:
            factor = 0.5 ** ((now - self.last_time) / self.half_life_s)
            evidence = self.reached[0].sum()
            if evidence * factor < self.min_evidence:
                factor = min(1.0, self.min_evidence / evidence) if evidence > 0 else 1.0
            self.reached *= factor
            self.accepted *= factor
        self.last_time = now if self.last_time is None else max(self.last_time, now)

    def update(self, steps: list[StepRecord], now: float | None = None) -> None:
        """Add the steps' acceptance counts, each weighted by its age at `now`."""
        if not steps:
            if now is not None:
                self.decay_to(now)
            return
        now = max(now or 0.0, max(s.time for s in steps))
        self.decay_to(now)
        # Per-request budgets' nodes were kept for looking likely: their rates would flatter the drafter.
        counted = [(s, *step_counts(s)) for s in steps if not s.config.per_request]
        first = [(r[0, 0], a[0, 0]) for _, r, a in counted if r.size]
        if first and self.workload_changed(sum(r for r, _ in first), sum(a for _, a in first)):
            self.reached[:] = 0.0
            self.accepted[:] = 0.0
            self.changes += 1
        for s, reached, accepted in counted:
            w = 0.5 ** ((now - s.time) / self.half_life_s)
            d, r = reached.shape
            self.reached[:d, :r] += w * reached
            self.accepted[:d, :r] += w * accepted

    def workload_changed(self, reached: float, accepted: float) -> bool:
        """Whether `accepted` of `reached` first-position candidates (one report's) cannot come
        from the rate the counts measured: the gap is material and statistically clear."""
        known, known_accepted = float(self.reached[0, 0]), float(self.accepted[0, 0])
        if reached < self.min_evidence or known < self.min_evidence:
            return False
        rate, known_rate = accepted / reached, known_accepted / known
        pooled = (accepted + known_accepted) / (reached + known)
        se = math.sqrt(max(pooled * (1.0 - pooled), 1e-12) * (1.0 / reached + 1.0 / known))
        return abs(rate - known_rate) >= self.change_gap and abs(rate - known_rate) >= self.change_z * se

    def conditional_rates(self) -> np.ndarray:
        """p[d][r] (depth index 0 = first draft token), shrunk towards the prior."""
        return (self.accepted + self.prior_weight * self.prior_rate) / (self.reached + self.prior_weight)

    def marginal_rates(self) -> np.ndarray:
        return marginal_from_conditional(self.conditional_rates())

    def expected_length(self, config: SpecConfig) -> float:
        return expected_accepted_length(config, self.marginal_rates())

    def copy(self, half_life_s: float | None = None) -> AcceptanceModel:
        """An independent copy (a new replica's start from its deployment's counts)."""
        return dataclasses.replace(self, half_life_s=half_life_s or self.half_life_s,
                                   reached=self.reached.copy(), accepted=self.accepted.copy())

    def observed_drafts(self) -> float:
        """Decayed number of sequences that verified at least one draft token."""
        return float(self.reached[0].sum())


def step_counts(step: StepRecord) -> tuple[np.ndarray, np.ndarray]:
    """(reached, accepted) per [depth, rank] of one step.

    Chains report per position only (vLLM): reached at position i is the number of sequences
    that drafted position i with positions < i accepted, estimated as
    min(accepted[i-1], drafted[i]) (exact when all sequences drafted the same length). At the
    first position every decoding sequence the drafter was asked for (step.draft_k >= 1)
    counts, drafted or not: a draft never proposed is a token not gained, so the rate then
    includes the n-gram drafter's proposal rate.

    Past the positions the step verified (all of them under `off`), its shadow counts fill
    in, by the same estimator, with every sequence whose shadow draft settled counting at the
    first position."""
    if step.reached_per_depth_rank:
        return (np.asarray(step.reached_per_depth_rank, dtype=float),
                np.asarray(step.accepted_per_depth_rank, dtype=float))
    k = min(max(len(step.drafted_per_pos), step.draft_k), MAX_DEPTH)
    first = max(step.num_drafts, step.num_decode_reqs) if step.draft_k >= 1 else None
    reached, accepted = _chain_counts(k, first, step.num_drafts, step.drafted_per_pos, step.accepted_per_pos)
    shadow_k = min(len(step.shadow_drafted_per_pos), MAX_DEPTH)
    if step.shadow_seqs and shadow_k > k:
        shadow_reached, shadow_accepted = _chain_counts(shadow_k, step.shadow_seqs, step.shadow_seqs,
                                                        step.shadow_drafted_per_pos, step.shadow_accepted_per_pos)
        reached = np.concatenate([reached, shadow_reached[k:]])
        accepted = np.concatenate([accepted, shadow_accepted[k:]])
    return reached, accepted


def _chain_counts(k: int, first: int | None, drafts: int, drafted_per_pos: list[int],
                  accepted_per_pos: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(reached, accepted) per position, shape (k, 1), from per-position counts. `first`: the
    sequences counted at the first position (asked for a draft, drafted or not), or None to
    count only those that drafted; `drafts`: sequences that drafted at least one token."""
    reached = np.zeros((k, 1))
    accepted = np.zeros((k, 1))
    prev = drafts
    for i in range(k):
        acc = accepted_per_pos[i] if i < len(accepted_per_pos) else 0
        drafted = drafted_per_pos[i] if i < len(drafted_per_pos) else 0
        reached[i, 0] = first if i == 0 and first is not None else min(prev, drafted)
        accepted[i, 0] = acc
        prev = acc
    return reached, accepted


def measured_proposal_rate(steps: list[StepRecord]) -> float | None:
    """Share of decoding sequences that got a draft when the drafter was asked for one
    (draft_k >= 1; an n-gram drafter may find none), or, in steps that verified none, when
    its shadow was (StepRecord.shadow_seqs); None when neither ever was."""
    asked = [s for s in steps if s.draft_k >= 1 and not s.config.per_request]  # budgets draft by choice
    shadowed = [s for s in steps if s.draft_k == 0 and s.shadow_seqs]
    eligible = sum(s.num_decode_reqs for s in asked) + sum(s.shadow_seqs for s in shadowed)
    if not eligible:
        return None
    drafted = sum(s.num_drafts for s in asked) + sum(s.shadow_drafted_per_pos[0] for s in shadowed)
    return min(drafted / eligible, 1.0)


def measured_acceptance(steps: list[StepRecord], max_k: int) -> list[float]:
    """Conditional acceptance per position over all `steps`, undecayed, proposal failures
    counted as rejections (AcceptanceModel's estimator)."""
    model = AcceptanceModel(half_life_s=1e12, prior_weight=1e-6)
    model.update(steps)
    return model.conditional_rates()[:max_k, 0].tolist()


def marginal_from_conditional(p: np.ndarray) -> np.ndarray:
    """q[d][r] = p[d][r] * prod_{r' < r} (1 - p[d][r'])."""
    rejected_before = np.cumprod(np.concatenate([np.ones((p.shape[0], 1)), 1 - p[:, :-1]], axis=1), axis=1)
    return p * rejected_before


def expected_accepted_length(config: SpecConfig, q: np.ndarray) -> float:
    """E for a tree given as widths per depth: 1 + sum_d prod_{j <= d} sum_{r < w_j} q[j][r].

    Every node at depth j has w_j children, so the chance that some node at depth d is
    accepted is the product over depths of the chance that one of the w_j candidates is."""
    total, reach = 1.0, 1.0
    for depth, width in enumerate(config.widths):
        if depth >= q.shape[0]:
            break
        reach *= float(q[depth, : min(width, q.shape[1])].sum())
        total += reach
    return total


def chain_expected_length(rates: list[float] | np.ndarray) -> float:
    """E = 1 + sum_i prod_{j <= i} p_j for a chain with conditional rates p_1..p_k."""
    return 1.0 + float(np.cumprod(np.asarray(rates, dtype=float)).sum()) if len(rates) else 1.0


# --------------------------------------------------------------------------- arbitrary trees
def ranks_and_depths(parents: list[int]) -> tuple[list[int], list[int]]:
    """Sibling rank and depth (1-based) of each node; parents[i] is -1 for the root's children.

    Nodes are in topological order; siblings are ranked in the order they appear."""
    ranks, depths = [], []
    seen_children: dict[int, int] = {}
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"parents must be topologically ordered: node {i} has parent {parent}")
        ranks.append(seen_children.get(parent, 0))
        seen_children[parent] = ranks[-1] + 1
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return ranks, depths


def tree_expected_length(parents: list[int], q: np.ndarray) -> float:
    """E = 1 + sum_v P(v) for any tree written as a parents array."""
    ranks, depths = ranks_and_depths(parents)
    prob: list[float] = []
    for i, parent in enumerate(parents):
        d, r = depths[i] - 1, ranks[i]
        edge = float(q[d, r]) if d < q.shape[0] and r < q.shape[1] else 0.0
        prob.append(edge * (1.0 if parent < 0 else prob[parent]))
    return 1.0 + sum(prob)


def best_tree(q: np.ndarray, budget: int, max_depth: int) -> tuple[float, list[int]]:
    """The tree of at most `budget` draft nodes and depth <= `max_depth` with the largest E
    (Sequoia's dynamic program over child allocations). Returns (E, parents array)."""
    max_rank = q.shape[1]
    max_depth = min(max_depth, q.shape[0])

    @functools.lru_cache(maxsize=None)
    def children(depth: int, rank: int, nodes: int) -> tuple[float, tuple[int, ...]]:
        """Best value of giving `nodes` nodes to the children ranked >= rank of a node at
        `depth`; returns (value, sizes of the subtrees of ranks rank, rank+1, ...)."""
        if nodes == 0 or depth >= max_depth or rank >= max_rank:
            return 0.0, ()
        best: tuple[float, tuple[int, ...]] = (0.0, ())
        for size in range(1, nodes + 1):
            sub_value, _ = subtree(depth + 1, size)
            rest_value, rest = children(depth, rank + 1, nodes - size)
            value = float(q[depth, rank]) * sub_value + rest_value
            if value > best[0] + 1e-15:
                best = (value, (size, *rest))
        return best

    @functools.lru_cache(maxsize=None)
    def subtree(depth: int, nodes: int) -> tuple[float, tuple[int, ...]]:
        """A subtree of `nodes` nodes whose root sits at `depth` (root counts 1)."""
        value, sizes = children(depth, 0, nodes - 1)
        return 1.0 + value, sizes

    parents: list[int] = []

    def build(parent: int, depth: int, sizes: tuple[int, ...]) -> None:
        # A parent's children are appended together, in rank order, before their subtrees.
        ids = []
        for _ in sizes:
            parents.append(parent)
            ids.append(len(parents) - 1)
        for node, size in zip(ids, sizes):
            build(node, depth + 1, subtree(depth + 1, size)[1])

    value, sizes = children(0, 0, budget)
    build(-1, 0, sizes)
    return 1.0 + value, parents


def iid_chain_expected_length(alpha: float, k: int) -> float:
    """Closed form (1 - alpha^(k+1)) / (1 - alpha); k + 1 when alpha = 1."""
    if math.isclose(alpha, 1.0):
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)
