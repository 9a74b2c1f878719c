"""The controller's guard rails: measured speed overrules the models when speculation loses,
and exploration is held to a small share of the steps.

The models (step time, acceptance) choose a config per batch bucket; they can be wrong in
ways only a measurement shows (a drafter that proposes and misses at T=0.7, a step-time
model fitted on another machine). So, per replica:
- `MeasuredSpeed` keeps, per (batch bucket, config), decayed sums of what the replica's
  decode steps measured: seconds of step time per output token of one sequence.
- `safe_config`: in the bucket the replica runs in, a speculative config whose measured
  seconds per token exceed `off`'s by more than `margin` (3%: the goal "never more than 3%
  slower than off"), both measured over at least MIN_STEPS recent steps, gives way to `off`.
- `prefer_budgets`: per-request budgets (`auto`, native engine) have no model the controller
  could price them with (each sequence's tree is the engine's own choice at every step), so
  they are chosen by measurement alone: in a bucket where `auto` was measured faster per
  token than the models' choice by more than `margin`, `auto` runs; where it runs and the
  other has no recent measurement, it stays.
- `ExplorationBudget`: decayed counts of steps run under an exploration trial and of all
  steps; a new trial starts only while trials are under a share of the steps (5% by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaspec.policy import SpecConfig
from adaspec.telemetry import StepRecord
from controller.policy_search import bucket_of

MIN_STEPS = 20.0  # decayed decode steps a (bucket, config) needs before its measurement counts
SPEED_HALF_LIFE_S = 60.0  # memory of the measured speeds (seconds)
BUDGET_HALF_LIFE_S = 300.0  # memory of the exploration budget's step counts (seconds)


def _decay(dt: float, half_life_s: float) -> float:
    return 0.5 ** (max(dt, 0.0) / half_life_s)


@dataclass
class _Sums:
    seconds_x_seqs: float = 0.0  # sum of step seconds x sequences decoded
    tokens: float = 0.0  # sum of output tokens of those sequences (decoded + drafts accepted)
    steps: float = 0.0
    updated_at: float = 0.0  # unix seconds


@dataclass
class MeasuredSpeed:
    """Measured seconds per output token of one sequence, per (batch bucket lo, config),
    decayed with half-life SPEED_HALF_LIFE_S."""

    sums: dict[tuple[int, SpecConfig], _Sums] = field(default_factory=dict)

    def add(self, steps: list[StepRecord], max_batch: int, now: float) -> None:
        """Take a report's steps; prefill steps say nothing about decoding and are left out."""
        for s in steps:
            if not s.num_decode_reqs or s.prefill_tokens:
                continue
            key = (bucket_of(s.batch_size, max_batch)[0], s.config)
            sums = self.sums.setdefault(key, _Sums(updated_at=now))
            keep = _decay(now - sums.updated_at, SPEED_HALF_LIFE_S)
            sums.seconds_x_seqs = keep * sums.seconds_x_seqs + s.duration_s * s.num_decode_reqs
            sums.tokens = keep * sums.tokens + s.num_decode_reqs + sum(s.accepted_per_pos)
            sums.steps = keep * sums.steps + 1.0
            sums.updated_at = now

    def seconds_per_token(self, bucket_lo: int, config: SpecConfig, now: float) -> float | None:
        """None until MIN_STEPS (decayed to `now`) were measured."""
        sums = self.sums.get((bucket_lo, config))
        if sums is None or sums.steps * _decay(now - sums.updated_at, SPEED_HALF_LIFE_S) < MIN_STEPS:
            return None
        return sums.seconds_x_seqs / sums.tokens

    def measured_recently(self, bucket_lo: int, config: SpecConfig, now: float) -> bool:
        return self.seconds_per_token(bucket_lo, config, now) is not None


def safe_config(chosen: SpecConfig, bucket_lo: int, measured: MeasuredSpeed, now: float, margin: float) -> SpecConfig:
    """`off` when `chosen` speculates and was measured more than `margin` slower per token
    than `off` in this bucket; `chosen` otherwise (also when either is not measured)."""
    if chosen.is_off:
        return chosen
    spec = measured.seconds_per_token(bucket_lo, chosen, now)
    off = measured.seconds_per_token(bucket_lo, SpecConfig.off(), now)
    if spec is None or off is None or spec <= (1.0 + margin) * off:
        return chosen
    return SpecConfig.off()


def prefer_budgets(chosen: SpecConfig, bucket_lo: int, in_force: SpecConfig, measured: MeasuredSpeed, now: float,
                   margin: float) -> SpecConfig:
    """`auto` instead of the models' `chosen` in this bucket when measured faster per token:
    by more than `margin` to switch to it, by no less than `margin` slower to stay on it (a
    hysteresis band); `chosen` when `auto` has no recent measurement here."""
    auto = SpecConfig.budget()
    if chosen == auto:
        return chosen
    auto_s = measured.seconds_per_token(bucket_lo, auto, now)
    if auto_s is None:
        return chosen
    chosen_s = measured.seconds_per_token(bucket_lo, chosen, now)
    if in_force == auto:
        return auto if chosen_s is None or auto_s <= (1.0 + margin) * chosen_s else chosen
    return auto if chosen_s is not None and (1.0 + margin) * auto_s < chosen_s else chosen


@dataclass
class ExplorationBudget:
    """Decayed steps run under an exploration trial and in all (half-life BUDGET_HALF_LIFE_S)."""

    trial_steps: float = 0.0
    all_steps: float = 0.0
    updated_at: float | None = None

    def add(self, steps: int, trial_steps: int, now: float) -> None:
        """Take a report's `steps`, `trial_steps` of which ran under a trial's policy."""
        keep = 1.0 if self.updated_at is None else _decay(now - self.updated_at, BUDGET_HALF_LIFE_S)
        self.all_steps = keep * self.all_steps + steps
        self.trial_steps = keep * self.trial_steps + trial_steps
        self.updated_at = now

    @property
    def share(self) -> float:
        """Share of the (decayed) steps that ran under a trial."""
        return self.trial_steps / self.all_steps if self.all_steps else 0.0

    def allows_trial(self, max_share: float) -> bool:
        """A trial may start while trials are under max_share of the steps; before any step
        was counted there is nothing to spend from."""
        return self.all_steps > 0 and self.share < max_share
