"""Per-request speculation budgets: which draft nodes of the whole batch are worth verifying.

A step under `auto` or `budgetN` (adaspec.policy) works in three moves:
1. offer: every decoding sequence's drafter proposes a candidate tree (the engine's offer
   shape, best-first, at most max_tree_nodes nodes);
2. estimate: each candidate node gets p = P(accepted), the product along its path of edge
   estimates P(child accepted | parent accepted) (`BudgetPlanner.node_probabilities`);
3. select: all nodes of the batch sorted by p; the first B are verified, B chosen to
   maximise predicted tokens per second (`best_budget`):
       (n + sum of the first B p's) / t(n sequences, n + B tokens, longest tree)
   where each of the n sequences gains its bonus token and t is the engine's own step-cost
   fit (`adaspec.step_cost.StepCost`). B = 0 is a valid answer; `budgetN` caps B at N. Attention runs over
   every row padded to the longest tree, so nodes per row are a cost of their own: the best
   set is not always a prefix of the batch's order (a greedy copy's deep chain ranks above
   every other row's first node, and makes all rows long). `best_selection` also tries the
   order cut to each sequence's k most likely nodes (k = 1, 2, 3, 4, 6, 8, ...), and keeps
   the best (k, B).
Each edge estimate is below 1 (MAX_EDGE), so a node's p is below its parent's and any prefix
of the order (cut per sequence or not) holds every kept node's ancestors: each sequence's
kept nodes form a rooted subtree, verified with the others in the engine's one pass.

Edge estimates (calibrated drafter confidence x the sequence's own record):
- the drafter's confidence in an edge: the share of the parent's matched occurrences that
  continue with the token (prompt lookup) or the draft model's probability of the token;
- `Calibration`: decayed counts of (reached: parent accepted, accepted) per sampling class
  (greedy, T <= 0.5, hotter), the sequence's previous step (no drafts, stopped short,
  accepted to the tree's depth), drafter key (the n-gram match length in tokens, 2, 3, 4+;
  0 for a draft model), depth group and confidence bin; the rate there, shrunk towards the
  rate of its coarse cell (sampling class and previous step only), itself shrunk towards a
  prior: a young engine learns the coarse rates within a few steps, the fine ones later;
- the sequence factor: (accepted + prior) / (expected + prior), its decayed draft tokens
  accepted against the calibrated estimates of the candidates it had reached. A sequence
  sampled at high temperature that keeps rejecting drifts towards 0 and gets no nodes while
  a greedy one beside it gets many. The factor stays within [0, MAX_FACTOR]: a run of luck
  must not make every deep node look certain.
Both learn in hindsight from every node offered, verified or not (`hindsight`): once the
sequence's output has moved past an offer, a node counts as reached if its parent's token is
the one the output took there, and as accepted if its own is. Every candidate is a point mass
(a matched run's token, a draft model's top-w child), and verification accepts such a
candidate with exactly the probability that the target emits its token (native_engine/verify.py),
so for a node that was not verified the output says what verifying it would have done, in
distribution. Learning only from verified nodes starves the deep nodes of long copied runs:
they are rarely kept while their estimate is low, so their estimate stays low (measured on
the mixed batch-4 set's greedy requests before this: the offers held 2.3-2.7x the draft
tokens the kept nodes got accepted, and nodes estimated below 0.1, 915 of the 1555
offered, were on the output's path 15% of the time).
- the batch's bias: predicted accepted tokens (the sum of the kept nodes' p) against those
  accepted, decayed; every p is scaled by it. Keeping the nodes that look best favours the
  ones whose estimate is too high (the winner's curse); this takes it back out.
Nodes deeper than the sequence's remaining tokens - 1 are worth nothing (p = 0).

Drafting has a cost of its own: prompt lookup's is nearly nothing, a draft model's one pass
per depth over every sequence offered. So before drafting, `should_draft` weighs what the
recent drafted steps' plans expected to gain (draft tokens accepted per sequence), what their
verify cost over a step without drafts (by the step-cost fit) and what drafting cost
(measured), against a step without drafts, and the engine drafts only when drafting pays;
after EXPLORE_EVERY steps without drafting one drafts anyway (the wait doubling while
drafting still does not pay, up to MAX_DRAFT_WAIT), so a drafter that starts paying is
noticed. Without it `auto` with the distilled draft model drafted every sequence at every
step and ran at a fifth of `off`'s speed at batch 16 (docs/benchmarks.md, A draft model's cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from adaspec.step_cost import StepCost
from native_engine.requests import Request, SamplingParams
from native_engine.tree import DraftTree, subtree
from native_engine.verify import Acceptance

CONFIDENCE_EDGES = (0.25, 0.5, 0.75, 0.999)  # confidence bins; the last holds certain edges (1.0)
MATCH_KEYS = 5  # drafter keys 0..4: 0 = a draft model, else the n-gram match length (4 = 4+)
SAMPLING_CLASSES = 3  # greedy, temperature <= 0.5, hotter
# Depth groups 1, 2, 3, 4-5, 6-7, 8-11, 12+ (1, 2-3, 4+ before): a copy on track tends to stay
# on it, but not equally at every depth, and one rate for every depth from 4 overrated the deep
# chains `auto` kept. Side by side, 2 rounds: auto / best static +0.2 to +10% in 5 of 6
# (batch, round) cells at batch 1, 4 and 16, -0.2% in the sixth (docs/benchmarks.md at 1dcc68e, Depth groups).
DEPTH_EDGES = (2, 3, 4, 6, 8, 12)
# What the sequence's previous budgeted step did: verified nothing, stopped short of its
# tree's depth, or accepted as deep as its tree went (a copy in progress usually goes on).
LAST_NONE, LAST_SHORT, LAST_ALL = 0, 1, 2
# Edge estimates stay below 1, so a child always ranks below its parent; and at most 0.9 with
# the sequence factor at most 1 (0.98 and 1.2 before): a copied run's deep chain, every edge
# near the cap, was overrated (nodes estimated 0.8-1.0 accepted 58-60% at batch 4), and its
# row made every row of the step long. Side by side: docs/benchmarks.md at 1dcc68e, Edge and factor caps.
MAX_EDGE = 0.9
MIN_P = 1e-3  # nodes less likely than this are never verified
PRIOR_RATE = 0.4  # calibrated edge rate where nothing was measured
PRIOR_WEIGHT = 2.0  # the prior counts as this many reached candidates
CALIBRATION_DECAY = 0.999  # per budgeted step: the calibration remembers a few thousand steps
SEQUENCE_PRIOR = 2.0  # the sequence factor's prior, in expected accepted tokens
SEQUENCE_DECAY = 0.8  # per offer of the sequence resolved in hindsight
MAX_FACTOR = 1.0  # the sequence factor's ceiling: its record can lower a sequence's estimates, not raise them
BIAS_PRIOR = 10.0  # the bias correction's prior, in tokens (predicted = accepted)
BIAS_DECAY = 0.99  # per budgeted step
# Every EXPLORE_EVERY budgeted steps the engine verifies twice the chosen nodes plus one per
# sequence: the cost fit needs steps longer than the ones it picks, or a per-token cost
# guessed too high would keep B at 0 and never be corrected.
EXPLORE_EVERY = 16
RELIABILITY_BINS = 10  # the estimates' reliability diagram: P(accepted) in bins of 0.1
DRAFT_DECAY = 0.9  # per drafted step: what drafting gained and cost, over about the last ten
# Drafting that costs less than this share of a step without drafts goes on even where it gains
# nothing (prompt lookup's, about 0.1%): the calibration keeps learning from its offers.
DRAFT_TOLERANCE = 0.02
# Steps without drafting before one drafts anyway: EXPLORE_EVERY, doubled each time drafting
# still does not pay after it, up to this many (a draft model's exploring step at batch 16 cost
# five bare steps: every sixteenth was a quarter of the time), back to EXPLORE_EVERY once it does.
MAX_DRAFT_WAIT = 256


CALIBRATION_SHAPE = (SAMPLING_CLASSES, 3, MATCH_KEYS, len(DEPTH_EDGES) + 1, len(CONFIDENCE_EDGES) + 1)


def sampling_class(params: SamplingParams) -> int:
    """0 greedy, 1 temperature <= 0.5, 2 hotter: acceptance falls with temperature."""
    if params.greedy:
        return 0
    return 1 if params.temperature <= 0.5 else 2


def confidence_bin(confidence: float) -> int:
    return int(np.searchsorted(CONFIDENCE_EDGES, confidence, side="right"))


def depth_group(depth: int) -> int:
    return int(np.searchsorted(DEPTH_EDGES, depth, side="right"))


def edge_confidences(tree: DraftTree) -> list[float]:
    """The drafter's confidence in each node given its parent: its path score over its
    parent's (scores are path probabilities, the root's being 1)."""
    out = []
    for i, p in enumerate(tree.parents):
        parent = 1.0 if p < 0 else tree.scores[p]
        out.append(min(tree.scores[i] / parent, 1.0) if parent > 0 else 0.0)
    return out


@dataclass
class Calibration:
    """Decayed counts per [sampling class, previous step, drafter key, depth group, confidence
    bin]: offered candidates reached (their parent accepted, in hindsight), and how many of
    those were accepted."""

    reached: np.ndarray = field(default_factory=lambda: np.zeros(CALIBRATION_SHAPE))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(CALIBRATION_SHAPE))

    def rates(self, cls: int, last: int, key: int) -> np.ndarray:
        """Edge acceptance [depth group, confidence bin] for this class, previous step and
        drafter key."""
        coarse = ((self.accepted[cls, last].sum() + PRIOR_WEIGHT * PRIOR_RATE)
                  / (self.reached[cls, last].sum() + PRIOR_WEIGHT))
        return (self.accepted[cls, last, key] + PRIOR_WEIGHT * coarse) / (self.reached[cls, last, key] + PRIOR_WEIGHT)

    def decay(self) -> None:
        self.reached *= CALIBRATION_DECAY
        self.accepted *= CALIBRATION_DECAY


# A budget this close to the best predicted rate counts as a tie. 3% before: at batch 1, where
# a node costs about 1 ms of a 21 ms step, it left a fifth of the acceptable draft tokens
# unverified (docs/benchmarks.md at 1dcc68e, The anchored step cost in the engine).
NEAR_BEST = 0.01
# The caps on nodes per sequence best_selection tries (besides no cap): every small one, then
# a few larger, so a 64-node offer costs about a dozen evaluations, not 64.
PER_SEQUENCE_CAPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


def best_budget(sorted_p: list[float], seqs: int, step_seconds: np.ndarray) -> int:
    """The smallest B in 0..len(step_seconds) - 1 whose predicted tokens per second,
    (seqs + sum(sorted_p[:B])) / step_seconds[B] when the B most likely nodes are verified,
    is within NEAR_BEST of the best (sorted_p descending, at least len(step_seconds) - 1 of
    them). Near-ties go to fewer nodes: a step's cost is certain where its gain is not."""
    gained = seqs + np.concatenate([[0.0], np.cumsum(sorted_p[: len(step_seconds) - 1])])
    rate = gained / np.maximum(step_seconds, 1e-9)
    return int(np.argmax(rate >= (1.0 - NEAR_BEST) * rate.max()))


def best_selection(ranked: list[tuple[float, int, int]], seqs: int,
                   step_seconds: Callable[[np.ndarray], np.ndarray], max_nodes: int | None = None
                   ) -> list[tuple[float, int, int]]:
    """The nodes of `ranked` (ranked_nodes of `seqs` sequences) to verify: for each k, the order
    cut to each sequence's k most likely nodes, of which `best_budget` keeps the first B; the
    (k, B) of the best predicted tokens per second, a larger k only where it beats the smaller
    ones by more than NEAR_BEST (long rows cost every row). At most `max_nodes` nodes.
    `step_seconds(longest)`: `StepCost.step_seconds` for prefixes whose longest tree holds
    longest[B] nodes. What it changed is measured in docs/benchmarks.md (per-sequence caps)."""
    if not ranked:
        return []
    p = np.array([r[0] for r in ranked])
    before = np.zeros(len(ranked), dtype=int)  # nodes of the same sequence ranked above each
    seen = [0] * seqs
    for j, (_, s, _) in enumerate(ranked):
        before[j] = seen[s]
        seen[s] += 1
    most = max(seen)
    caps = [most] if seqs == 1 else sorted({k for k in PER_SEQUENCE_CAPS if k < most} | {most})
    best_rate, best = -1.0, np.zeros(0, dtype=int)
    for k in caps:
        idx = np.flatnonzero(before < k)[:max_nodes]
        longest = np.concatenate([[0.0], np.maximum.accumulate(before[idx] + 1.0)])
        seconds = step_seconds(longest)
        budget = best_budget(p[idx], seqs, seconds)
        rate = (seqs + p[idx[:budget]].sum()) / max(float(seconds[budget]), 1e-9)
        if rate > best_rate * (1.0 + NEAR_BEST):
            best_rate, best = rate, idx[:budget]
    return [ranked[j] for j in best]


def ranked_nodes(probs: list[list[float]]) -> list[tuple[float, int, int]]:
    """(p, sequence, node) of every node with p > MIN_P, most likely first (ties: earlier
    sequence, then earlier node)."""
    return sorted(((p, s, i) for s, ps in enumerate(probs) for i, p in enumerate(ps) if p > MIN_P),
                  key=lambda t: (-t[0], t[1], t[2]))


def select_nodes(probs: list[list[float]], budget: int) -> list[list[int]]:
    """Per sequence, the nodes among the batch's `budget` most likely (ranked_nodes), in node
    order."""
    return by_sequence(ranked_nodes(probs)[:budget], len(probs))


def by_sequence(ranked: list[tuple[float, int, int]], seqs: int) -> list[list[int]]:
    """The nodes of `ranked` grouped per sequence, in node order."""
    kept: list[list[int]] = [[] for _ in range(seqs)]
    for _, s, i in ranked:
        kept[s].append(i)
    return [sorted(k) for k in kept]


@dataclass
class Offer:
    """A sequence's candidate tree at one step, kept until its output shows which nodes the
    target would have accepted."""

    start: int  # output tokens when offered: a node at depth d stands for output[start + d - 1]
    tree: DraftTree
    edges: list[float]  # calibrated edge rate per node (no sequence factor)
    cells: list[tuple[int, ...]]  # calibration cell per node
    probs: list[float]  # P(accepted) per node as ranked (sequence factor and bias included)


def hindsight(tree: DraftTree, future: list[int], finished: bool) -> list[tuple[int, bool]] | None:
    """(node, accepted) for every node of `tree` whose parent the output went through (the
    root's children first), given `future`: the output tokens after the tree's root. None
    while the output is too short to tell (the path is still matching where it ends and the
    sequence goes on)."""
    out: list[tuple[int, bool]] = []
    children = tree.children()
    parent, depth = -1, 0
    while True:
        below = children[parent + 1]
        if not below:
            return out
        if depth >= len(future):
            return out if finished else None
        hit = next((i for i in below if tree.tokens[i] == future[depth]), None)
        out += [(i, i == hit) for i in below]
        if hit is None:
            return out
        parent, depth = hit, depth + 1


@dataclass
class BudgetPlan:
    """What one budgeted step chose."""

    budget: int  # nodes kept (B)
    predicted: float  # expected draft tokens accepted: the sum of the kept nodes' p, bias correction undone
    # The rule's choice, before any exploration (EXPLORE_EVERY) added nodes: its expected
    # draft tokens accepted (bias-corrected) and the seconds it adds to a step without drafts.
    expected: float = 0.0
    verify_extra_s: float = 0.0


class BudgetPlanner:
    """The engine's per-request budget state: calibration, step cost, and the step counter."""

    def __init__(self) -> None:
        self.calibration = Calibration()
        self.cost = StepCost()
        self.steps = 0
        self.predicted = 0.0  # decayed sum of the kept nodes' p
        self.accepted = 0.0  # decayed draft tokens accepted in the same steps
        # How good the estimates are, in hindsight, over every offered node (not decayed; a
        # benchmark resets them): [P bin] -> (nodes, nodes the output went through).
        self.reliability = np.zeros((RELIABILITY_BINS, 2))
        self.offered_accepted = 0  # draft tokens the offers held: accepted had every node been verified
        # Drafted steps' plans, decayed (DRAFT_DECAY), per sequence: expected draft tokens
        # accepted, verify seconds over a step without drafts, drafting seconds (measured);
        # and steps since the last drafted.
        self.drafted_steps = 0.0
        self.gain_per_seq = 0.0
        self.verify_extra_per_seq_s = 0.0
        self.draft_per_seq_s = 0.0
        self.undrafted_steps = 0
        self.explore_next = False  # set by should_draft after draft_wait steps without drafting
        self.draft_wait = EXPLORE_EVERY

    @property
    def bias(self) -> float:
        """Accepted over predicted draft tokens (decayed; 1 before any step)."""
        return (self.accepted + BIAS_PRIOR) / (self.predicted + BIAS_PRIOR)

    def node_probabilities(self, req: Request, tree: DraftTree, bias: float = 1.0
                           ) -> tuple[list[float], list[float], list[tuple[int, ...]]]:
        """(P(node accepted), calibrated edge rate, calibration cell) per node of `tree`;
        `bias` scales every P (the batch's bias correction)."""
        cls = sampling_class(req.params)
        key = min(tree.match_len, MATCH_KEYS - 1)
        rates = self.calibration.rates(cls, req.last_verify, key)
        factor = min((req.draft_accepted + SEQUENCE_PRIOR) / (req.draft_expected + SEQUENCE_PRIOR), MAX_FACTOR)
        room = req.params.max_tokens - len(req.output) - 1  # the bonus token takes the last place
        depths = tree.depths()
        probs, edges, cells = [], [], []
        for i, (conf, parent) in enumerate(zip(edge_confidences(tree), tree.parents)):
            cell = (cls, req.last_verify, key, depth_group(depths[i]), confidence_bin(conf))
            edge = float(rates[cell[3:]])
            p = min(edge * factor, MAX_EDGE) * (bias if parent < 0 else probs[parent])
            probs.append(p if depths[i] <= room else 0.0)
            edges.append(edge)
            cells.append(cell)
        return probs, edges, cells

    def plan(self, decode: list[Request], offers: list[DraftTree], max_nodes: int | None,
             context_tokens: int) -> tuple[list[DraftTree], BudgetPlan]:
        """The trees to verify: the batch's best nodes, as many as pay (at most max_nodes)."""
        self.steps += 1
        bias = min(self.bias, 1.0 / MAX_EDGE)
        estimates = [self.node_probabilities(r, t, bias) for r, t in zip(decode, offers)]
        probs = [e[0] for e in estimates]
        ranked = ranked_nodes(probs)
        n = len(decode)
        chosen = best_selection(ranked, n, lambda longest: self.cost.step_seconds(n, context_tokens, longest),
                                max_nodes)
        # What drafting gains under the rule (should_draft), exploration or not: the chosen
        # nodes' expected accepted tokens and the verify seconds they add to a bare step.
        expected = sum(p for p, _, _ in chosen)
        longest = max((len(k) for k in by_sequence(chosen, n)), default=0)  # nodes of the longest kept tree
        seconds = self.cost.step_seconds(n, context_tokens, np.array([0.0] * len(chosen) + [float(longest)]))
        explore = self.steps % EXPLORE_EVERY == 0 or self.explore_next
        self.explore_next = False
        if explore:
            cap = len(ranked) if max_nodes is None else min(max_nodes, len(ranked))
            chosen = ranked[: min(cap, 2 * len(chosen) + n)]
        trees = [subtree(t, k) for t, k in zip(offers, by_sequence(chosen, n))]
        for req, offer, (probs, edges, cells) in zip(decode, offers, estimates):
            if len(offer):
                req.offers.append(Offer(len(req.output), offer, edges, cells, probs))
        # Before the bias correction: the correction is measured against the raw estimates.
        return trees, BudgetPlan(budget=len(chosen), predicted=sum(p for p, _, _ in chosen) / bias,
                                 expected=expected, verify_extra_s=float(seconds[-1] - seconds[0]))

    def should_draft(self, seqs: int, context_tokens: int) -> bool:
        """Whether drafting this step pays, by the recent drafted steps' plans: (seqs +
        expected accepted) / (a step without drafts + their verify and drafting seconds) at
        least seqs / (a step without drafts), less DRAFT_TOLERANCE. Where drafting costs next
        to nothing this holds whenever the plans verified what pays. True before any drafted
        step, and after `draft_wait` steps without (that step then explores; MAX_DRAFT_WAIT)."""
        if self.drafted_steps == 0.0:
            return True
        if self.undrafted_steps >= self.draft_wait:
            self.explore_next = True  # and verify more than pays: what drafting gains is measured afresh
            return True
        bare = float(self.cost.step_seconds(seqs, context_tokens, np.zeros(1))[0])
        drafted = bare + seqs * (self.verify_extra_per_seq_s + self.draft_per_seq_s)
        if (1.0 + self.gain_per_seq + DRAFT_TOLERANCE) * bare >= drafted:
            self.draft_wait = EXPLORE_EVERY
            return True
        if self.undrafted_steps == 0:  # the step before drafted, and drafting still does not pay
            self.draft_wait = min(2 * self.draft_wait, MAX_DRAFT_WAIT)
        return False

    def record_draft(self, seqs: int, seconds: float, plan: BudgetPlan) -> None:
        """A drafted step: its drafting seconds, and its plan's expected draft tokens accepted
        and verify seconds over a step without drafts (BudgetPlan.expected, verify_extra_s)."""
        d = DRAFT_DECAY
        self.drafted_steps = d * self.drafted_steps + 1.0
        w = 1.0 / self.drafted_steps  # the decayed mean's weight of this step
        self.gain_per_seq += w * (plan.expected / seqs - self.gain_per_seq)
        self.verify_extra_per_seq_s += w * (plan.verify_extra_s / seqs - self.verify_extra_per_seq_s)
        self.draft_per_seq_s += w * (seconds / seqs - self.draft_per_seq_s)
        self.undrafted_steps = 0

    def observe(self, decode: list[Request], trees: list[DraftTree], results: list[Acceptance],
                plan: BudgetPlan) -> None:
        """After the step's tokens are appended: learn from every offer the outputs have now
        resolved (`hindsight`), and the bias correction from the verified trees."""
        self.calibration.decay()
        self.predicted = BIAS_DECAY * self.predicted + plan.predicted
        self.accepted = BIAS_DECAY * self.accepted + sum(r.num_accepted for r in results)
        for req, tree, result in zip(decode, trees, results):
            if not len(tree):
                req.last_verify = LAST_NONE
            else:
                req.last_verify = LAST_ALL if result.num_accepted >= max(tree.depths()) else LAST_SHORT
            self.resolve_offers(req)

    def resolve_offers(self, req: Request) -> None:
        """Count the nodes of `req`'s pending offers that its output has resolved."""
        pending = []
        for offer in req.offers:
            nodes = hindsight(offer.tree, req.output[offer.start:], req.finished)
            if nodes is None:
                pending.append(offer)
                continue
            expected = gained = 0.0
            for i, hit in nodes:
                self.calibration.reached[offer.cells[i]] += 1.0
                self.calibration.accepted[offer.cells[i]] += float(hit)
                expected += offer.edges[i]
                gained += float(hit)
            req.draft_accepted = SEQUENCE_DECAY * req.draft_accepted + gained
            req.draft_expected = SEQUENCE_DECAY * req.draft_expected + expected
            self._score(offer, {i for i, hit in nodes if hit}, len(req.output) - offer.start, req.finished)
        req.offers = pending

    def _score(self, offer: Offer, on_path: set[int], known: int, finished: bool) -> None:
        """Add a resolved offer to the reliability diagram: a node is on the path or not,
        except below where a finished output ends (`known` tokens after the root)."""
        self.offered_accepted += len(on_path)
        # Vectorised: this runs for every resolved offer of every budgeted step.
        bins = np.minimum((np.asarray(offer.probs) * RELIABILITY_BINS).astype(int), RELIABILITY_BINS - 1)
        hits = np.zeros(len(bins))
        hits[list(on_path)] = 1.0
        if finished:
            decided = np.asarray(offer.tree.depths()) <= known
            bins, hits = bins[decided], hits[decided]
        self.reliability[:, 0] += np.bincount(bins, minlength=RELIABILITY_BINS)
        self.reliability[:, 1] += np.bincount(bins, weights=hits, minlength=RELIABILITY_BINS)

    def record_step(self, duration_s: float, seqs: int, tokens: int, padded_tokens: int, context_tokens: int) -> None:
        """A decode step's measured time (no prefill in it), for the cost fit."""
        self.cost.add(duration_s, seqs, tokens, padded_tokens, context_tokens)
