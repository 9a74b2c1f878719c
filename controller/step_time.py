"""Step-time model: how long one engine step takes, for any batch and speculation config.

Features of a step (AdaTree; docs/papers.md section 3):
- batch_size: requests in the step
- tokens_per_seq: tokens each decoding sequence runs through the target (1 + draft tokens
  verified); the memory-bound -> compute-bound knee lies along batch_size * tokens_per_seq
- draft_passes: drafter passes for the next step (the config's depth)
- context_tokens: KV tokens the batch attends to
- prefill_tokens: prompt tokens processed in the same step

The model is the project's one step-cost model (adaspec.step_cost), its columns that a step's
telemetry can tell apart (ROOFLINE_COLUMNS: fixed, per token, per KV token, per prefill token,
per drafter pass), fitted by non-negative least squares over the deployment's whole history
(so never faster with more of anything, and it extrapolates: a controller that has only seen
chain3 at batch 48 must still price `off` there), times a learned correction: once `min_samples_xgb` steps are
known, an XGBoost regressor fits the log-ratio of measured to roofline time (the non-linear
memory-bound -> compute-bound knee), starting from the roofline as its base margin. Before
any data, a prior roofline. `monotone_table` enforces the physics on predictions the
controller uses (not faster with a larger batch or more draft tokens). Held-out accuracy is
reported at every fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from adaspec import step_cost
from adaspec.policy import SpecConfig
from adaspec.telemetry import StepRecord

FEATURES = ("batch_size", "tokens_per_seq", "draft_passes", "context_tokens", "prefill_tokens")


def step_features(step: StepRecord) -> list[float]:
    """The model's features of a recorded step."""
    decode = step.num_decode_reqs
    tokens_per_seq = (step.scheduled_tokens - step.prefill_tokens) / decode if decode else 0.0
    return [float(step.batch_size), tokens_per_seq, float(step.config.depth),
            float(step.context_tokens), float(step.prefill_tokens)]


def decode_features(batch: int, config: SpecConfig, context_per_seq: float,
                    prefill_per_step: float = 0.0, proposal_rate: float = 1.0) -> list[float]:
    """Features of a steady-state decode step of `batch` sequences under `config`, where a
    sequence gets a draft with probability `proposal_rate` (n-gram lookup may find none)."""
    return [float(batch), 1.0 + proposal_rate * config.num_nodes, float(config.depth),
            batch * context_per_seq, prefill_per_step]


def measured_context_per_seq(steps: list[StepRecord]) -> float | None:
    """KV tokens per sequence over `steps` (decode_features' context_per_seq); None when the
    steps ran no sequence."""
    seqs = sum(s.batch_size for s in steps)
    return sum(s.context_tokens for s in steps) / seqs if seqs else None


@dataclass
class FitReport:
    kind: str  # prior | linear | xgboost
    samples: int
    holdout_samples: int
    holdout_mape: float | None  # mean absolute percentage error on held-out steps


# XGBoost's training parameters. A model saved as JSON keeps none of them, so a booster
# loaded from a checkpoint takes its nthread from here (controller/checkpoint.py).
XGB_PARAMS = {"max_depth": 4, "eta": 0.05, "subsample": 0.9, "tree_method": "hist",
              "objective": "reg:squarederror", "nthread": 1, "seed": 0}


# The step-cost model's columns the controller fits. It sees a step's tokens, not its layout
# (no padding, no verify pass timed alone); the memory-bound -> compute-bound knee is left to
# the learned correction, and per-sequence and first-draft terms stay out: fitted on one batch
# size they decide how the roofline extrapolates to others (same held-out error on the
# committed profiles either way; docs/controller.md).
ROOFLINE_COLUMNS = ("fixed", "tokens", "context_per_1000", "prefill_tokens", "draft_passes", "draft_passes_x_seqs")
_ROOFLINE_INDEX = [step_cost.COLUMN[c] for c in ROOFLINE_COLUMNS]
# The controller's coefficients are per KV token, not per thousand: its checkpoints hold them so.
_ROOFLINE_UNITS = np.array([1.0, 1.0, 1000.0, 1.0, 1.0, 1.0])


def _roofline_design(x: np.ndarray) -> np.ndarray:
    """The roofline's design rows (ROOFLINE_COLUMNS of adaspec.step_cost) for rows of FEATURES."""
    batch, tokens_per_seq, passes, context, prefill = x.T
    tokens = batch * tokens_per_seq
    return step_cost.features(batch, tokens, tokens, context, prefill, passes)[:, _ROOFLINE_INDEX] * _ROOFLINE_UNITS


@dataclass
class StepTimeModel:
    """Predicts engine step duration (seconds) from step features."""

    min_samples_xgb: int = 200
    max_samples: int = 50_000
    # Seconds per unit of ROOFLINE_COLUMNS: fixed, token, KV token, prefill token, drafter pass, pass x sequence.
    prior_coef: tuple[float, ...] = (0.05, 0.002, 0.0, 0.0002, 0.005, 0.0)
    x: list[list[float]] = dataclasses.field(default_factory=list)
    y: list[float] = dataclasses.field(default_factory=list)
    coef: np.ndarray | None = None
    booster: object | None = None  # xgboost.Booster
    report: FitReport = dataclasses.field(default_factory=lambda: FitReport("prior", 0, 0, None))

    def add(self, steps: list[StepRecord]) -> None:
        for s in steps:
            if s.duration_s > 0:
                self.x.append(step_features(s))
                self.y.append(s.duration_s)
        if len(self.y) > self.max_samples:  # keep the newest
            del self.x[: len(self.y) - self.max_samples]
            del self.y[: len(self.y) - self.max_samples]

    def fit(self, holdout_fraction: float = 0.2, seed: int = 0) -> FitReport:
        """Refit on everything known; report the error on a random held-out share."""
        n = len(self.y)
        if n < 8:
            self.report = FitReport("prior", n, 0, None)
            return self.report
        x, y = np.asarray(self.x), np.asarray(self.y)
        rng = np.random.default_rng(seed)
        test = rng.random(n) < holdout_fraction
        if test.all() or not test.any():
            test[: max(1, n // 5)] = True
        kind = "xgboost" if n >= self.min_samples_xgb else "linear"
        predictor = self._train(kind, x[~test], y[~test])
        mape = float(np.mean(np.abs(predictor(x[test]) - y[test]) / y[test]))
        self._train(kind, x, y)  # the model in use learns from every sample
        self.report = FitReport(kind, int(n), int(test.sum()), mape)
        return self.report

    def _train(self, kind: str, x: np.ndarray, y: np.ndarray):
        from scipy.optimize import nnls

        self.coef, _ = nnls(_roofline_design(x), y)
        self.booster = None
        if kind == "xgboost":
            import xgboost

            # Relative error matters (a 5 ms step and a 500 ms step alike): fit log time,
            # as a correction on top of the roofline.
            data = xgboost.DMatrix(x, label=np.log(y), base_margin=self._log_roofline(x))
            self.booster = xgboost.train(XGB_PARAMS, data, num_boost_round=300)
        return self.predict

    def predict(self, x: np.ndarray | list[list[float]]) -> np.ndarray:
        """Step durations (seconds) for rows of features."""
        x = np.asarray(x, dtype=float)
        if self.booster is not None:
            return np.exp(self.booster.inplace_predict(x, base_margin=self._log_roofline(x)))
        return np.exp(self._log_roofline(x))

    @property
    def prefill_s_per_token(self) -> float:
        """The fit's seconds per prompt token prefilled."""
        coef = self.coef if self.coef is not None else self.prior_coef
        return float(coef[ROOFLINE_COLUMNS.index("prefill_tokens")])

    def _log_roofline(self, x: np.ndarray) -> np.ndarray:
        coef = self.coef if self.coef is not None else np.asarray(self.prior_coef)
        return np.log(np.maximum(_roofline_design(x) @ coef, 1e-4))


def monotone_table(step_s: np.ndarray) -> np.ndarray:
    """Running maximum along the batch axis (axis 0): a step never gets faster with more
    sequences. Rows are batch sizes, columns configs."""
    return np.maximum.accumulate(step_s, axis=0)


@dataclass
class StepTimeScale:
    """One replica's steps against its deployment's model: a decayed mean of
    log(measured / predicted) over its decode steps (half-life `half_life_s`, short: a machine
    turns busy at once), whose exp scales every step time the controller prices for that
    replica. The model is fitted over the deployment's whole history (a shipped profile
    included), so it cannot see that the replica's machine is busy now (other processes on
    its cores, a neighbour's burst); the scale follows that within seconds, uniformly over
    batch sizes and configs.

    Each report's steps are predicted with the scale from before the report, then update it:
    `error` is the decayed mean relative error of those predictions (out of sample; half-life
    `error_half_life_s`), and `unscaled_error` the same for the model alone."""

    half_life_s: float = 2.0
    error_half_life_s: float = 10.0
    log_ratio: float = 0.0  # decayed sum of log(measured / predicted)
    weight: float = 0.0  # decayed number of steps in it
    error_sum: float = 0.0
    unscaled_error_sum: float = 0.0
    error_weight: float = 0.0
    updated_at: float | None = None

    @property
    def factor(self) -> float:
        return float(np.exp(self.log_ratio / self.weight)) if self.weight > 0 else 1.0

    @property
    def error(self) -> float | None:
        return self.error_sum / self.error_weight if self.error_weight > 0 else None

    @property
    def unscaled_error(self) -> float | None:
        return self.unscaled_error_sum / self.error_weight if self.error_weight > 0 else None

    def update(self, measured: np.ndarray, predicted: np.ndarray, now: float) -> None:
        """Take one report's decode steps: measured and (unscaled) predicted seconds."""
        if not len(measured):
            return
        dt = 0.0 if self.updated_at is None else max(now - self.updated_at, 0.0)
        keep, keep_error = 0.5 ** (dt / self.half_life_s), 0.5 ** (dt / self.error_half_life_s)
        self.error_sum = keep_error * self.error_sum + float(np.sum(np.abs(predicted * self.factor - measured) / measured))
        self.unscaled_error_sum = keep_error * self.unscaled_error_sum + float(np.sum(np.abs(predicted - measured) / measured))
        self.error_weight = keep_error * self.error_weight + len(measured)
        self.log_ratio = keep * self.log_ratio + float(np.sum(np.log(measured / predicted)))
        self.weight = keep * self.weight + len(measured)
        self.updated_at = now
