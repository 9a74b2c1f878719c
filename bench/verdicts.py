"""A sweep's verdicts from rounds of per-request TPOT, each with a 95% bootstrap interval
(bench/compare.py), each goal called met, missed or inconclusive (pure: numpy only).

Every ratio is a speed ratio: reference mean TPOT / adaptive mean TPOT (>1: adaptive faster).
- Oracle: at each (dataset, rate), the static policy with the lowest mean TPOT on the
  selection rounds (the first half of the rounds, at least one); adaptive is scored against
  it on the other rounds only. Picking the best of several noisy cells and grading with the
  same cells favours the oracle (winner's curse); held-out rounds do not. Goal >= 0.97.
- Off: at each point, off / adaptive over every round. Goal >= 0.97 (never more than 3%
  slower than not speculating).
- Every static policy: the geometric mean over points of static / adaptive, every round.
  Goal > 1 (adaptive better than each).
A goal is met when the interval's low end clears it, missed when its high end falls short,
inconclusive otherwise.
"""

from __future__ import annotations

from bench.compare import RatioInterval, bootstrap_geomean_ratio, bootstrap_ratio, mean

ORACLE_GOAL = 0.97
OFF_GOAL = 0.97
STATIC_GOAL = 1.0

Rounds = list[list[float]]  # per round: the TPOT (seconds) of each request
Point = tuple[str, float]  # (dataset, rate)


def split_rounds(n: int) -> tuple[list[int], list[int]]:
    """(selection rounds, scoring rounds) of n >= 2 rounds: the first n // 2 select."""
    if n < 2:
        raise ValueError("choosing the oracle on held-out rounds needs at least 2 rounds")
    half = n // 2
    return list(range(half)), list(range(half, n))


def pooled_mean(rounds: Rounds) -> float:
    values = [v for r in rounds for v in r]
    return sum(values) / len(values) if values else float("inf")


def _interval_dict(interval: RatioInterval, goal: float) -> dict:
    return {"ratio": interval.ratio, "low": interval.low, "high": interval.high, "goal": goal,
            "verdict": interval.meets(goal)}


def sweep_verdicts(tpots: dict[Point, dict[str, Rounds]], adaptive: str = "adaptive", off: str = "off",
                   resamples: int = 2000) -> dict:
    """tpots: point -> policy -> rounds. Points without adaptive, or where a policy has fewer
    rounds than adaptive, leave that policy out there."""
    points = []
    for point in sorted(tpots):
        row = tpots[point]
        if adaptive not in row:
            continue
        n = len(row[adaptive])
        select, score = split_rounds(n)
        statics = {p: r for p, r in row.items() if p != adaptive and len(r) == n}
        if not statics:
            continue
        oracle = min(statics, key=lambda p: pooled_mean([statics[p][i] for i in select]))
        vs_oracle = bootstrap_ratio([statics[oracle][i] for i in score], [row[adaptive][i] for i in score], mean,
                                    resamples=resamples)
        entry = {"dataset": point[0], "rate": point[1], "rounds": n, "selection_rounds": select,
                 "scoring_rounds": score, "oracle": oracle,
                 "vs_oracle": _interval_dict(vs_oracle, ORACLE_GOAL),
                 "adaptive_tpot_s": pooled_mean(row[adaptive]),
                 "tpot_s": {p: pooled_mean(r) for p, r in statics.items()}}
        if off in statics:
            entry["vs_off"] = _interval_dict(bootstrap_ratio(statics[off], row[adaptive], mean, resamples=resamples),
                                             OFF_GOAL)
        points.append(entry)
    everywhere = sorted(set.intersection(*(set(p["tpot_s"]) for p in points))) if points else []
    vs_static = {}
    for policy in everywhere:
        pairs = [(tpots[(p["dataset"], p["rate"])][policy], tpots[(p["dataset"], p["rate"])][adaptive])
                 for p in points]
        vs_static[policy] = _interval_dict(bootstrap_geomean_ratio(pairs, mean, resamples=resamples), STATIC_GOAL)
    return {"points": points, "vs_static_geomean": vs_static,
            "goals": {
                "oracle_every_point": _overall([p["vs_oracle"]["verdict"] for p in points]),
                "off_every_point": _overall([p["vs_off"]["verdict"] for p in points if "vs_off" in p]),
                "beats_every_static": _overall([v["verdict"] for v in vs_static.values()]),
            }}


def switching_ceiling(segments: dict[str, list[list[list[float]]]], best_static: str, rounds: list[int]) -> float:
    """How much faster than `best_static` a policy could have been by switching between the
    static policies at segment boundaries: best_static's pooled mean TPOT over `rounds` divided
    by that of, in every round and segment, the static policy with the lowest mean there.

    segments: static policy -> round -> segment -> the TPOTs (seconds) of that segment's
    requests. The per-segment picks are made with hindsight on the same requests, so this is
    an upper estimate: a phase-change goal above it cannot be met on that trace by switching
    among these policies, whatever the controller does."""
    best, picked = [], []
    for i in rounds:
        for j, own in enumerate(segments[best_static][i]):
            cells = [segments[p][i][j] for p in segments if segments[p][i][j]]
            if own and cells:
                best += own
                picked += min(cells, key=lambda c: sum(c) / len(c))
    return pooled_mean([best]) / pooled_mean([picked]) if picked else float("nan")


def _overall(verdicts: list[str]) -> str:
    """met when every part is met, missed when any is missed, else inconclusive."""
    if not verdicts:
        return "inconclusive"
    if "missed" in verdicts:
        return "missed"
    return "met" if all(v == "met" for v in verdicts) else "inconclusive"
