"""The step-cost model: the seconds one engine step takes, from what the step runs.

One model of one quantity, a linear function of a step's shape (`features`, columns
`COLUMNS`), fitted at the time scale each user needs:
- the controller (controller/step_time.py): every step a deployment recorded, with
  non-negative coefficients so that it extrapolates to configs it has not run (more of
  anything is never faster), and a learned multiplicative correction on top;
- the native engine's budget planner (native_engine/budget.py): `StepCost` below, forgetting
  all but its last ~100 steps and anchored by verify passes it timed before serving, solved
  per batch size;
- the budget replay (bench/budget_replay.py): the same `StepCost` over the verify passes a
  benchmark measured, with nothing forgotten.

A step's shape: `seqs` sequences; `tokens` the target verifies (one per decoding sequence plus
the draft tokens); `padded_tokens`, the tokens of the layout the pass runs (a tree engine pads
every row to the longest tree; equal to `tokens` where nothing is padded); `context_tokens` KV
tokens attended; `prefill_tokens` prompt tokens prefilled in the same step; `draft_passes`
drafter passes run inside the step (a draft model's depth; 0 where drafting is timed apart);
`verify_only`: the target's verify pass alone, without the drafting and bookkeeping around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Tokens per step where the marginal cost of a token may change: flat while the weights' memory
# traffic dominates a pass, steeper once compute does.
COST_KNOTS = (8, 32, 128)
COLUMNS = ("fixed", "seqs", "tokens", *(f"tokens_over_{k}" for k in COST_KNOTS), "padded_tokens",
           "context_per_1000", "any_draft", "verify_only", "prefill_tokens", "draft_passes",
           "draft_passes_x_seqs")
COLUMN = {name: i for i, name in enumerate(COLUMNS)}


def features(seqs, tokens, padded_tokens, context_tokens, prefill_tokens=0.0, draft_passes=0.0,
             verify_only=False) -> np.ndarray:
    """[..., len(COLUMNS)] design rows; every argument a scalar or an array (broadcast).
    `any_draft` sets a column of its own because a pass of one token per row takes another path
    than a verify pass (a compiled graph, another matmul layout): the first draft token costs
    more than the next ones."""
    seqs, tokens, padded, context, prefill, passes, alone = np.broadcast_arrays(
        *(np.asarray(v, dtype=float) for v in (seqs, tokens, padded_tokens, context_tokens, prefill_tokens,
                                                 draft_passes, verify_only)))
    cols = [np.ones_like(tokens), seqs, tokens]
    cols += [np.maximum(tokens - k, 0.0) for k in COST_KNOTS]
    cols += [padded, context / 1000.0, (tokens > seqs).astype(float), alone, prefill, passes, passes * seqs]
    return np.stack(cols, axis=-1)


def coefficients(**per_column: float) -> np.ndarray:
    """A coefficient vector from {column name: seconds per unit}; the other columns 0."""
    coef = np.zeros(len(COLUMNS))
    for name, value in per_column.items():
        coef[COLUMN[name]] = value
    return coef


# StepCost's prior and its precision: 1 s of standard deviation per coefficient, so a few steps
# outweigh it; it fades with the recent steps' weight, and a floor of it keeps the solve
# well-posed.
ENGINE_PRIOR = coefficients(fixed=0.02, seqs=0.002, tokens=0.001, tokens_over_8=0.002, tokens_over_32=0.002,
                            tokens_over_128=0.002, padded_tokens=0.0005, context_per_1000=0.001)
PRIOR_PRECISION = 1.0
PRIOR_FLOOR = 1e-6
ANCHOR_SPREAD = 16.0  # an anchor's weight falls this much per doubling between its batch size and the step's


@dataclass
class StepCost:
    """The step-cost model fitted by weighted least squares over two sets of passes:
    - whole steps (`add`), weighted forgetting ** age (0.99: about the last 100), so the fit
      follows the regime the engine runs in now (1.0: every step counts alike);
    - anchors (`add_anchor`): verify passes of set layouts timed apart, never forgotten. An
      engine's own steps alone are nearly collinear (under one policy the tokens, the padding
      and the sequences move together), and a fit on them alone extrapolates to the budgets
      it did not run: measured on SmolLM2-135M at batch 4, it priced a node per sequence at
      5.7 ms where it cost 3.1 (docs/native-engine.md, Anchored step cost). An anchor times
      the verify pass only: the `verify_only` column takes up what the rest of a step adds,
      whole steps pinning the level and anchors the slopes. One linear model does not fit
      every batch size alike (the marginal node at batch 1 costs a fraction of what the
      global fit says), so the fit is solved per batch size, an anchor counting
      ANCHOR_SPREAD times less per doubling between its batch size and the one predicted.
    The prior (`prior`, the initial coefficients) fades like the oldest step."""

    forgetting: float = 0.99
    prior: np.ndarray = field(default_factory=lambda: ENGINE_PRIOR.copy())
    prior_precision: float = PRIOR_PRECISION  # how many steps' worth the prior counts, roughly
    samples: int = 0  # whole steps added

    def __post_init__(self) -> None:
        n = len(self.prior)
        self._recent = (self.prior_precision * np.eye(n), self.prior_precision * self.prior)  # decayed X'WX, X'Wy
        self._anchored: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # batch size -> X'X, X'y of its anchors
        self._solved: dict[int, np.ndarray] = {}  # batch size -> coefficients, until the next pass added
        # Every anchor as added, (seconds, seqs, tokens, padded_tokens, context_tokens): what
        # NativeEngine.load_or_calibrate_step_cost caches for the next engine of the same layout.
        self.anchor_passes: list[tuple[float, int, int, int, int]] = []

    @property
    def anchors(self) -> int:
        """Anchor passes added."""
        return len(self.anchor_passes)

    def add(self, duration_s: float, seqs: int, tokens: int, padded_tokens: int, context_tokens: int) -> None:
        """A whole decode step's measured seconds."""
        x = features(seqs, tokens, padded_tokens, context_tokens)
        a, b = self._recent
        self._recent = (self.forgetting * a + np.outer(x, x), self.forgetting * b + duration_s * x)
        self.samples += 1
        self._solved.clear()

    def add_anchor(self, duration_s: float, seqs: int, tokens: int, padded_tokens: int, context_tokens: int) -> None:
        """A verify pass's measured seconds (no drafting, planning or committing around it)."""
        x = features(seqs, tokens, padded_tokens, context_tokens, verify_only=True)
        n = len(self.prior)
        a, b = self._anchored.get(seqs, (np.zeros((n, n)), np.zeros(n)))
        self._anchored[seqs] = (a + np.outer(x, x), b + duration_s * x)
        self.anchor_passes.append((duration_s, seqs, tokens, padded_tokens, context_tokens))
        self._solved.clear()

    def coefficients(self, seqs: int) -> np.ndarray:
        """The fit's coefficients for steps of `seqs` sequences."""
        if seqs not in self._solved:
            a = self._recent[0] + PRIOR_FLOOR * np.eye(len(self.prior))
            b = self._recent[1] + PRIOR_FLOOR * self.prior
            for size, (aa, ab) in self._anchored.items():
                weight = ANCHOR_SPREAD ** -abs(np.log2(size / seqs))
                a, b = a + weight * aa, b + weight * ab
            self._solved[seqs] = np.linalg.solve(a, b)
        return self._solved[seqs]

    def seconds(self, seqs: int, tokens, padded_tokens, context_tokens: int, verify_only: bool = False):
        """Predicted seconds of a whole step, or of its verify pass alone (`verify_only`);
        `tokens` and `padded_tokens` may be arrays."""
        return features(seqs, tokens, padded_tokens, context_tokens, verify_only=verify_only) @ self.coefficients(seqs)

    def step_seconds(self, seqs: int, context_tokens: int, longest: np.ndarray) -> np.ndarray:
        """[B] predicted seconds of a step verifying B = 0..len(longest) - 1 draft nodes
        besides the sequences' roots, the longest tree then holding longest[B] nodes; never
        decreasing in B (more work is never faster) and never below 10 µs per extra node."""
        nodes = np.arange(len(longest))
        raw = self.seconds(seqs, seqs + nodes, seqs * (1 + longest), context_tokens)
        floor = raw[0] + 1e-5 * nodes
        return np.maximum.accumulate(np.maximum(raw, floor))
