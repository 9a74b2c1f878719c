"""Comparing two variants measured in rounds: a ratio with a bootstrap confidence interval,
and a verdict that can say "inconclusive" (pure: numpy only).

Rounds of one variant are not interchangeable with requests: the machine drifts between
rounds (cells of one benchmark move 10-15% between runs here), so the interval comes from a
two-stage (hierarchical) bootstrap: draw the rounds with replacement, then the requests of
each drawn round with replacement, and recompute the statistic of each variant on the
pooled draw. The percentile interval of the ratio then carries both the spread between
rounds and the spread between requests (Davison & Hinkley, Bootstrap Methods, 1997, 3.8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Statistic = Callable[[np.ndarray], float]
Verdict = Literal["better", "worse", "inconclusive"]
GoalVerdict = Literal["met", "missed", "inconclusive"]


def mean(values: np.ndarray) -> float:
    return float(np.mean(values))


def p99(values: np.ndarray) -> float:
    return float(np.percentile(values, 99))


@dataclass(frozen=True)
class RatioInterval:
    """statistic(a) / statistic(b) on all the data, and its bootstrap interval."""

    ratio: float
    low: float
    high: float
    level: float  # e.g. 0.95

    def verdict(self, lower_is_better: bool = True) -> Verdict:
        """`better` when the whole interval lies on a's good side of 1, `worse` on the other
        side, `inconclusive` when it holds 1."""
        if self.high < 1.0:
            return "better" if lower_is_better else "worse"
        if self.low > 1.0:
            return "worse" if lower_is_better else "better"
        return "inconclusive"

    def meets(self, goal: float) -> GoalVerdict:
        """Against a goal `ratio >= goal`: `met` when the whole interval clears it, `missed`
        when the whole interval falls short, `inconclusive` when it holds the goal."""
        if self.low >= goal:
            return "met"
        if self.high < goal:
            return "missed"
        return "inconclusive"

    def __str__(self) -> str:
        return f"{self.ratio:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _pooled_draw(rounds: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    picked = rng.integers(len(rounds), size=len(rounds))
    return np.concatenate([rounds[i][rng.integers(len(rounds[i]), size=len(rounds[i]))] for i in picked])


def _rounds(rounds: Sequence[Sequence[float]]) -> list[np.ndarray]:
    out = [np.asarray(r, dtype=float) for r in rounds if len(r)]
    if not out:
        raise ValueError("each variant needs at least one round with values")
    return out


def _interval(ratio: float, draws: np.ndarray, level: float) -> RatioInterval:
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return RatioInterval(ratio=float(ratio), low=float(low), high=float(high), level=level)


def bootstrap_geomean_ratio(pairs: Sequence[tuple[Sequence[Sequence[float]], Sequence[Sequence[float]]]],
                            statistic: Statistic, resamples: int = 2000, level: float = 0.95,
                            seed: int = 0) -> RatioInterval:
    """The geometric mean over points of statistic(a) / statistic(b), each point given as
    (a's rounds, b's rounds), with a percentile interval: every draw redraws every point's
    rounds and requests as bootstrap_ratio does."""
    points = [(_rounds(a), _rounds(b)) for a, b in pairs]
    if not points:
        raise ValueError("no points")

    def geomean(ratios: list[float]) -> float:
        return float(np.exp(np.mean(np.log(ratios))))

    ratio = geomean([statistic(np.concatenate(a)) / statistic(np.concatenate(b)) for a, b in points])
    rng = np.random.default_rng(seed)
    draws = np.array([geomean([statistic(_pooled_draw(a, rng)) / statistic(_pooled_draw(b, rng)) for a, b in points])
                      for _ in range(resamples)])
    return _interval(ratio, draws, level)


def bootstrap_ratio(a_rounds: Sequence[Sequence[float]], b_rounds: Sequence[Sequence[float]], statistic: Statistic,
                    resamples: int = 2000, level: float = 0.95, seed: int = 0) -> RatioInterval:
    """statistic(a) / statistic(b) over the pooled values of every round of each variant, with
    a `level` percentile interval from `resamples` two-stage bootstrap draws (module
    docstring). Rounds without values are left out; ValueError if a variant has none."""
    a, b = _rounds(a_rounds), _rounds(b_rounds)
    ratio = statistic(np.concatenate(a)) / statistic(np.concatenate(b))
    rng = np.random.default_rng(seed)
    draws = np.array([statistic(_pooled_draw(a, rng)) / statistic(_pooled_draw(b, rng)) for _ in range(resamples)])
    return _interval(ratio, draws, level)


def bootstrap_paired_ratio(a_rounds: Sequence[Sequence[float]], b_rounds: Sequence[Sequence[float]],
                           statistic: Statistic, resamples: int = 2000, level: float = 0.95,
                           seed: int = 0) -> RatioInterval:
    """statistic(a) / statistic(b) where a_rounds[r][i] and b_rounds[r][i] are the same request
    (same prompt, arrival time and sampling) served by a and by b: each draw picks rounds, then
    requests within them, with replacement, and takes the same picks from both. Differences
    between the rounds' request sets then cancel instead of widening the interval as they do
    in bootstrap_ratio. ValueError if the two are not paired (lengths differ)."""
    if len(a_rounds) != len(b_rounds) or any(len(a) != len(b) for a, b in zip(a_rounds, b_rounds)):
        raise ValueError("paired rounds must have the same number of requests in each round")
    pairs = [(np.asarray(a, dtype=float), np.asarray(b, dtype=float)) for a, b in zip(a_rounds, b_rounds) if len(a)]
    if not pairs:
        raise ValueError("no paired values")
    ratio = statistic(np.concatenate([a for a, _ in pairs])) / statistic(np.concatenate([b for _, b in pairs]))
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        picked = rng.integers(len(pairs), size=len(pairs))
        idx = [rng.integers(len(pairs[r][0]), size=len(pairs[r][0])) for r in picked]
        a = np.concatenate([pairs[r][0][i] for r, i in zip(picked, idx)])
        b = np.concatenate([pairs[r][1][i] for r, i in zip(picked, idx)])
        draws.append(statistic(a) / statistic(b))
    return _interval(ratio, np.array(draws), level)
