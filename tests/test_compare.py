"""bench/compare.py: ratios with a two-stage bootstrap interval and a verdict that can say
"inconclusive"; bench/client.py's realistic sampling mix. Pure: no server."""

from __future__ import annotations

import numpy as np
import pytest

from bench.client import SAMPLED, realistic_mix
from bench.compare import RatioInterval, bootstrap_paired_ratio, bootstrap_ratio, mean, p99


def rounds(center: float, n_rounds: int, n: int, seed: int, spread: float = 0.1) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [list(rng.normal(center, spread * center, size=n)) for _ in range(n_rounds)]


def test_a_clear_difference_is_called():
    faster, slower = rounds(0.8, 3, 40, seed=1), rounds(1.0, 3, 40, seed=2)
    interval = bootstrap_ratio(faster, slower, mean, resamples=300)
    assert interval.ratio == pytest.approx(0.8, rel=0.05)
    assert interval.low < interval.ratio < interval.high < 1.0
    assert interval.verdict() == "better"
    assert bootstrap_ratio(slower, faster, mean, resamples=300).verdict() == "worse"
    assert interval.verdict(lower_is_better=False) == "worse"


def test_no_difference_is_inconclusive():
    a, b = rounds(1.0, 3, 40, seed=3), rounds(1.0, 3, 40, seed=4)
    interval = bootstrap_ratio(a, b, mean, resamples=300)
    assert interval.low < 1.0 < interval.high and interval.verdict() == "inconclusive"


def test_rounds_that_disagree_widen_the_interval():
    # The same requests, but one variant's rounds sit 30% apart (the machine drifted): the
    # round-level draw must show it, where pooling the requests alone would not.
    steady = [[1.0 + 0.01 * i for i in range(30)]] * 3
    drifting = [[v * f for v in steady[0]] for f in (0.7, 1.0, 1.3)]
    narrow = bootstrap_ratio(steady, steady, mean, resamples=300)
    wide = bootstrap_ratio(drifting, steady, mean, resamples=300)
    assert (wide.high - wide.low) > 5 * (narrow.high - narrow.low)
    assert wide.verdict() == "inconclusive"


def test_pairing_cancels_what_the_requests_of_a_round_share():
    """Each round sends other prompts (here: rounds 30% apart, requests spread 5x within a
    round); both variants serve the same ones, b 10% slower on every request. Paired, the
    interval is tight around 1/1.1; unpaired, the prompts' differences swamp it."""
    rng = np.random.default_rng(5)
    a = [list(level * rng.uniform(0.2, 1.0, size=20)) for level in (0.7, 1.0, 1.3)]
    noise = [rng.normal(1.0, 0.01, size=20) for _ in a]
    b = [list(np.array(r) * 1.1 * e) for r, e in zip(a, noise)]
    paired = bootstrap_paired_ratio(a, b, mean, resamples=300)
    unpaired = bootstrap_ratio(a, b, mean, resamples=300)
    assert paired.low < 1 / 1.1 < paired.high < 0.93 and paired.verdict() == "better"
    assert unpaired.verdict() == "inconclusive" and (unpaired.high - unpaired.low) > 10 * (paired.high - paired.low)
    with pytest.raises(ValueError, match="same number of requests"):
        bootstrap_paired_ratio(a, [r[:-1] for r in b], mean)


def test_p99_and_empty_rounds():
    a = [[1.0] * 99 + [10.0], []]
    b = [[1.0] * 100]
    assert p99(np.array(a[0])) > 1.0
    assert bootstrap_ratio(a, b, mean, resamples=50).ratio == pytest.approx(1.09)
    with pytest.raises(ValueError, match="at least one round"):
        bootstrap_ratio([[]], b, mean)


def test_interval_prints_ratio_and_bounds():
    assert str(RatioInterval(0.9, 0.85, 0.97, 0.95)) == "0.900 [0.850, 0.970]"


def test_realistic_mix_has_the_asked_share_and_stops_at_eos():
    mix = realistic_mix(40, seed=0, greedy_share=0.25)
    assert len(mix) == 40 and sum(m.temperature == 0 for m in mix) == 10
    assert all(not m.ignore_eos for m in mix) and mix.count(SAMPLED) == 30
    assert mix == realistic_mix(40, seed=0, greedy_share=0.25) != realistic_mix(40, seed=1, greedy_share=0.25)


def test_routing_benchmark_summary_and_report(tmp_path):
    """bench/routing_cluster.py's summary and files, on made-up rounds (no cluster)."""
    from bench.routing_cluster import summary, write

    def made_up(routing: str, scale: float, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        return {"routing": routing, **{m: list(scale * rng.uniform(0.5, 1.5, 30)) for m in ("ttft", "tpot", "e2e")}}
    rounds = [made_up("spec_aware", 0.7, 0), made_up("power_of_two", 1.0, 1),
              made_up("power_of_two", 1.0, 2), made_up("spec_aware", 0.7, 3)]
    table = summary(rounds, resamples=200)
    assert set(table) == {f"{m}_{s}_s" for m in ("ttft", "tpot", "e2e") for s in ("mean", "p99")}
    assert table["e2e_mean_s"]["verdict"] == "better" and len(table["e2e_mean_s"]["pair_ratios"]) == 2
    result = {"settings": {"replicas": 3, "rounds": 2}, "summary": table,
              "simulated": {"e2e_mean_s": 0.95, "e2e_p99_s": 0.9}}
    write(tmp_path, result)
    text = (tmp_path / "table.md").read_text()
    assert "| e2e_mean_s |" in text and "better" in text and "0.95" in text
    assert (tmp_path / "routing.png").stat().st_size > 0 and (tmp_path / "routing.json").is_file()


# ---------------------------------------------------------------------------- sweep verdicts
def test_goal_verdicts_can_say_met_missed_and_inconclusive():
    assert RatioInterval(1.0, 0.98, 1.02, 0.95).meets(0.97) == "met"
    assert RatioInterval(0.9, 0.85, 0.96, 0.95).meets(0.97) == "missed"
    assert RatioInterval(0.97, 0.93, 1.01, 0.95).meets(0.97) == "inconclusive"


def test_geomean_ratio_over_points():
    from bench.compare import bootstrap_geomean_ratio

    pairs = [(rounds(1.0, 3, 40, seed=1), rounds(0.5, 3, 40, seed=2)),  # a twice b's
             (rounds(1.0, 3, 40, seed=3), rounds(2.0, 3, 40, seed=4))]  # a half b's
    g = bootstrap_geomean_ratio(pairs, mean, resamples=300)
    assert g.ratio == pytest.approx(1.0, rel=0.05) and g.low < 1.0 < g.high


def test_sweep_verdicts_pick_the_oracle_on_held_out_rounds_and_call_each_goal():
    from bench.verdicts import split_rounds, sweep_verdicts

    assert split_rounds(3) == ([0], [1, 2]) and split_rounds(4) == ([0, 1], [2, 3])
    with pytest.raises(ValueError):
        split_rounds(1)
    # chain2 is 20% faster than off everywhere; adaptive matches chain2 at one point and is
    # as slow as off at the other.
    tpots = {("sharegpt", 1.0): {"off": rounds(1.0, 3, 40, seed=1), "chain2": rounds(0.8, 3, 40, seed=2),
                                 "adaptive": rounds(0.8, 3, 40, seed=3)},
             ("codeedit", 1.0): {"off": rounds(1.0, 3, 40, seed=4), "chain2": rounds(0.8, 3, 40, seed=5),
                                 "adaptive": rounds(1.0, 3, 40, seed=6)}}
    v = sweep_verdicts(tpots, resamples=300)
    by_point = {p["dataset"]: p for p in v["points"]}
    assert all(p["oracle"] == "chain2" and p["selection_rounds"] == [0] for p in v["points"])
    assert by_point["sharegpt"]["vs_oracle"]["verdict"] in ("met", "inconclusive")
    assert by_point["codeedit"]["vs_oracle"]["verdict"] == "missed"  # 0.8x the oracle
    assert by_point["sharegpt"]["vs_off"]["verdict"] == "met"  # 1.25x off
    assert v["goals"]["oracle_every_point"] == "missed"
    assert set(v["vs_static_geomean"]) == {"off", "chain2"}
    assert v["vs_static_geomean"]["off"]["ratio"] > 1.05
