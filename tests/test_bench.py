"""The benchmark harness: metrics, arrivals, datasets, policies, verdicts, plots, CLI errors;
and one real `adaspec bench` run against the shared server (slow)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys

import numpy as np
import pytest

from cli.main import main as cli_main
from bench.client import RequestResult, arrival_times, arrivals_until
from adaspec.datasets import split_of
from prepare.datasets import load_prompts, recover_records
from bench.metrics import summarize, tpot_s
from bench.phase import merge_rounds, parse_trace, settle_times, trace_workload
from bench.policies import interleaved, profiled_table, resolve
from bench.replica_probe import PolicyChange, trace_of
from bench.report import geomean, phase_goal, verdicts, write_report
from bench.verdicts import switching_ceiling
from adaspec.policy import SpecConfig
from adaspec.telemetry import StepRecord


# ---------------------------------------------------------------------------- metrics
def _req(sent, ttft, e2e, tokens, itl=(), error=""):
    return RequestResult("p", "sharegpt", sent, e2e, ttft, list(itl), tokens, 10, error)


def test_tpot_ttft_itl_and_percentiles_from_synthetic_timings():
    # 3 requests: TPOT = (e2e - ttft) / (tokens - 1) = 0.1, 0.2, 0.3 s
    rs = [_req(0.0, 0.5, 0.5 + 0.1 * 9, 10, itl=[0.1] * 9),
          _req(1.0, 1.0, 1.0 + 0.2 * 9, 10, itl=[0.2] * 9),
          _req(2.0, 1.5, 1.5 + 0.3 * 9, 10, itl=[0.3] * 9)]
    assert tpot_s(rs[1]) == pytest.approx(0.2)
    m = summarize(rs, slo_ttft_s=1.0, slo_tpot_s=0.25)
    assert m.completed == 3 and m.errors == 0
    assert m.tpot_s.mean == pytest.approx(0.2)
    assert m.tpot_s.p50 == pytest.approx(0.2)
    assert m.tpot_s.p99 == pytest.approx(0.2 + 0.98 * 0.1)  # linear interpolation between 0.2 and 0.3
    assert m.ttft_s.mean == pytest.approx(1.0)
    assert m.itl_s.mean == pytest.approx(0.2)
    # duration: first send (0) -> last completion (2 + 1.5 + 2.7 = 6.2 s)
    assert m.duration_s == pytest.approx(6.2)
    assert m.output_throughput == pytest.approx(30 / 6.2)
    assert m.request_throughput == pytest.approx(3 / 6.2)
    # goodput: TTFT <= 1 and TPOT <= 0.25 -> the first two
    assert m.goodput == pytest.approx(2 / 6.2)


def test_errors_and_single_token_requests_are_counted_but_not_timed():
    rs = [_req(0.0, 0.2, 0.2, 1), _req(0.0, None, 0.1, 0, error="APIError: boom")]
    m = summarize(rs, 1.0, 1.0)
    assert (m.completed, m.errors) == (1, 1)
    assert m.tpot_s.mean is None and m.ttft_s.mean == pytest.approx(0.2)


# ---------------------------------------------------------------------------- arrivals
def test_poisson_arrivals_have_the_asked_mean_rate_and_unit_cv():
    t = arrival_times(4.0, 20000, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)
    assert arrival_times(4.0, 50, seed=1) == t[:50]  # same seed, same times


def test_burstiness_changes_variance_not_mean():
    for b in (0.25, 4.0):
        gaps = [y - x for x, y in zip(*(lambda t: (t, t[1:]))(arrival_times(2.0, 20000, 3, b)))]
        assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
        # gamma(shape b): coefficient of variation 1/sqrt(b)
        assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1 / math.sqrt(b), rel=0.08)


def test_rate_inf_sends_everything_at_once_and_timed_arrivals_stop_at_the_end():
    assert arrival_times(float("inf"), 5, 0) == [0.0] * 5
    t = arrivals_until(2.0, 1000.0, seed=2)
    assert max(t) < 1000.0 and len(t) == pytest.approx(2000, rel=0.08)
    with pytest.raises(ValueError):
        arrival_times(0.0, 3, 0)


# ---------------------------------------------------------------------------- datasets
def test_recover_records_from_a_truncated_json_list():
    text = json.dumps([{"id": "a", "v": [1, 2]}, {"id": "b", "v": "x, y"}, {"id": "c", "v": 3}])
    cut = text[: text.index('"c"') + 6]  # inside the third record
    assert [r["id"] for r in recover_records(cut)] == ["a", "b"]
    assert [r["id"] for r in recover_records(text)] == ["a", "b", "c"]
    assert recover_records("[") == []


def test_load_prompts_is_deterministic_and_split():
    a = load_prompts("humaneval", 8, seed=3, split="test")
    assert [p.id for p in a] == [p.id for p in load_prompts("humaneval", 8, seed=3, split="test")]
    assert [p.id for p in a] != [p.id for p in load_prompts("humaneval", 8, seed=4, split="test")]
    assert all(split_of(p.id) == "test" for p in a) and not any(p.chat for p in a)
    train = {p.id for p in load_prompts("humaneval", None, 0, split="train")}
    assert train.isdisjoint(p.id for p in load_prompts("humaneval", None, 0, split="test"))
    # seed None: the dataset's own order, so "the first n prompts" are the same everywhere
    assert [p.id for p in load_prompts("humaneval", 3, seed=None)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_code_edit_prompts_carry_their_function_and_split_by_task():
    edits = load_prompts("codeedit", None, 0, split="test")
    tasks = {p.source_id for p in edits}
    assert tasks == {p.id for p in load_prompts("humaneval", None, 0, split="test")}
    assert len(edits) == 3 * len(tasks)  # every edit of every test task, no train task
    for p in edits:
        assert p.chat and p.dataset == "codeedit" and p.id.startswith(p.source_id + "/")
        assert p.reference_output.strip() in p.text  # the reply mostly copies the prompt
    train_tasks = {p.source_id for p in load_prompts("codeedit", None, 0, split="train")}
    assert train_tasks.isdisjoint(tasks)


def test_mixed_alternates_chat_and_code_edit():
    mixed = load_prompts("mixed", 10, seed=1, split="test")
    assert [p.dataset for p in mixed] == ["sharegpt", "codeedit"] * 5
    assert [p.id for p in mixed] == [p.id for p in load_prompts("mixed", 10, seed=1, split="test")]


def test_request_mix_realistic_by_default_synthetic_only_when_asked():
    from bench.client import SYNTHETIC, RequestMix

    mix = RequestMix().samplings(40, seed=0)
    assert sum(s.temperature == 0 for s in mix) == 20 and not any(s.ignore_eos for s in mix)
    assert "realistic mix: 50% greedy" in RequestMix().describe(64)
    assert RequestMix(ignore_eos=True, temperature=0).samplings(3, 0) == [SYNTHETIC] * 3
    assert "SYNTHETIC" in RequestMix.synthetic().describe(64)
    hot = RequestMix(temperature=1.0, top_p=0.8).samplings(3, 0)
    assert {(s.temperature, s.top_p, s.ignore_eos) for s in hot} == {(1.0, 0.8, False)}
    assert RequestMix(temperature=0.0).samplings(1, 0)[0].top_p == 1.0  # top_p means nothing when greedy


def test_results_from_before_the_request_mix_read_as_synthetic():
    from bench.harness import BenchSettings

    old = {"url": "http://x", "dataset": "sharegpt", "rate": 1.0, "num_prompts": 4, "max_tokens": 64, "label": "off"}
    assert BenchSettings.model_validate(old).request_mix.ignore_eos
    assert not BenchSettings(url="http://x", dataset="sharegpt", rate=1.0, num_prompts=4).request_mix.ignore_eos


def test_reply_caps_come_from_the_datasets_reply_in_model_tokens():
    from bench.harness import reply_token_caps

    prompts = load_prompts("sharegpt", 20, seed=0, split="test")
    caps = reply_token_caps(prompts, "smollm2-135m-instruct", 64)
    assert all(1 <= c <= 64 for c in caps) and len(set(caps)) > 1  # some replies are shorter than the cap
    estimated = reply_token_caps(prompts, "no-such-model-here", 10_000)
    assert estimated == [max(1, len(p.reference_output) // 4) for p in prompts]


# ---------------------------------------------------------------------------- policies
def _step(t, batch, config, version=1, drafts=0, accepted=()):
    return StepRecord(time=t, duration_s=0.1 if config == "off" else 0.12, batch_size=batch, num_decode_reqs=batch,
                      scheduled_tokens=batch, prefill_tokens=0, context_tokens=10, config=SpecConfig.parse(config),
                      policy_version=version, num_drafts=drafts, drafted_per_pos=[drafts] * len(accepted),
                      accepted_per_pos=list(accepted))


def test_profiled_table_picks_the_faster_k_per_batch():
    # chain2 accepts 1.5 tokens per step on top of the bonus: 2.5 / 0.12 s beats 1 / 0.1 s at batch 1;
    # at batch 8 chain2's steps take 0.5 s (2.5 / 0.5 = 5 < 1 / 0.1 = 10): off wins.
    steps = [_step(i, 1, "off") for i in range(5)] + [_step(i, 8, "off") for i in range(5)]
    steps += [_step(i, 1, "chain2", drafts=10, accepted=(8, 7)) for i in range(5)]
    slow = [_step(i, 8, "chain2", drafts=10, accepted=(8, 7)) for i in range(5)]
    for s in slow:
        s.duration_s = 0.5
    assert profiled_table(steps + slow, grid=(1, 2, 8)) == "1-2:chain2,3+:off"


def test_resolve_names_and_interleaving():
    ps = resolve(["off", "chain2", 'table:"1-2:chain4,3+:off"', "adaptive"], None)
    assert [p.table for p in ps] == ["1+:off", "1+:chain2", "1-2:chain4,3+:off", None]
    assert [p.max_depth for p in ps] == [0, 2, 4, 0]
    with pytest.raises(Exception, match="profile"):
        resolve(["table:profiled"], None)
    orders = [[p.name for p in interleaved(ps, r)] for r in range(4)]
    assert all(sorted(o) == sorted(p.name for p in ps) for o in orders)
    assert len({o[0] for o in orders}) > 1 and len({o[-1] for o in orders}) > 1  # nobody always first/last


def test_trace_of_steps_reports_acceptance_k_and_policy_changes():
    steps = {"r": [_step(100.5, 1, "chain2", 1, drafts=4, accepted=(2, 1)),
                   _step(101.5, 2, "off", 2), _step(101.7, 2, "off", 2)]}
    tr = trace_of(steps, start_unix=100.0, policies=["1+:chain2", "1+:off"])
    assert tr.steps == 3 and tr.mean_accepted_length == pytest.approx(1 + 3 / 4)
    assert tr.acceptance_rate == pytest.approx(3 / 8)
    assert [p.mean_k for p in tr.timeline] == [2.0, 0.0]
    assert [(round(c.t, 2), str(c.config)) for c in tr.policy_changes] == [(1.4, "off")]


def test_phase_trace_and_settle_times():
    segs = parse_trace("sharegpt:2:20,humaneval:1:30")
    prompts, offsets, starts = trace_workload(segs, seed=0)
    assert starts == [0.0, 20.0]
    assert {p.dataset for p, o in zip(prompts, offsets) if o < 20} == {"sharegpt"}
    assert {p.dataset for p, o in zip(prompts, offsets) if o >= 20} == {"humaneval"}  # cycled: 20 in the split
    changes = [PolicyChange(t=t, replica_id="r", version=i, config="chain1") for i, t in enumerate([3.0, 5.0, 26.0])]
    st = settle_times(changes, starts, 50.0)
    assert [(s["changes"], s["settle_s"]) for s in st] == [(2, 5.0), (1, 6.0)]
    with pytest.raises(ValueError, match="DATASET:RATE:SECONDS"):
        parse_trace("sharegpt:2")


# ---------------------------------------------------------------------------- verdicts and report
def test_verdicts_both_ways():
    tpot = {("s", 1.0): {"off": 0.10, "chain2": 0.08, "adaptive": 0.081},
            ("s", 4.0): {"off": 0.10, "chain2": 0.20, "adaptive": 0.102}}
    v = verdicts(tpot)
    assert [p["oracle"] for p in v["points"]] == ["chain2", "off"]
    assert v["points"][0]["vs_oracle"] == pytest.approx(0.08 / 0.081)
    assert v["goal_oracle_every_point"]
    assert v["best_static"] == "off"  # geomean 0.1 < sqrt(0.08 * 0.2)
    assert v["adaptive_vs_static_geomean"]["off"] == pytest.approx(0.1 / geomean([0.081, 0.102]))
    assert v["goal_beats_every_static"]
    tpot[("s", 4.0)]["adaptive"] = 0.2  # adaptive stuck on chain2 at high load
    v = verdicts(tpot)
    assert not v["goal_oracle_every_point"] and not v["goal_beats_every_static"]
    assert v["points"][1]["vs_oracle"] == pytest.approx(0.5)


def test_draft_tpot_summary_turns_vllm_counters_into_ratios_and_plots(tmp_path):
    from bench.draft_tpot import plot, summary_rows

    counters = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 40,
                "vllm:spec_decode_num_accepted_tokens": 12}
    rows = summary_rows({"off": {"mean_tpot_ms": 60.0, "spec_metrics": {}},
                         "draft_model_k4": {"mean_tpot_ms": 45.0, "spec_metrics": counters}})
    assert rows[0] == {"run": "off", "mean_tpot_ms": 60.0, "tpot_ratio": 1.0, "acceptance": None,
                       "mean_accepted_length": None}
    assert rows[1]["tpot_ratio"] == pytest.approx(0.75)
    assert rows[1]["acceptance"] == pytest.approx(12 / 40)
    assert rows[1]["mean_accepted_length"] == pytest.approx(1 + 12 / 10)  # bonus token included
    plot(rows, tmp_path / "tpot.png", "d")
    assert (tmp_path / "tpot.png").stat().st_size > 1000


def _run(dataset, rate, policy, tpot, order):
    metrics = {"tpot_s": {"mean": tpot, "p50": tpot, "p99": 1.5 * tpot}, "output_throughput": 1 / tpot,
               "completed": 4, "errors": 0}
    telemetry = {"mean_accepted_length": 1.5, "mean_k": 2.0,
                 "timeline": [{"t": 0.0, "steps": 3, "mean_batch": 1.0, "mean_k": 2.0}]}
    return {"dataset": dataset, "rate": rate, "policy": policy, "table": None, "order": order,
            "result": {"metrics": metrics, "telemetry": telemetry}}


def test_report_writes_markdown_and_plots_and_states_the_goals(tmp_path):
    runs = [_run(d, r, p, t, i) for i, (d, r, p, t) in enumerate(
        [(d, r, p, 0.1 + 0.01 * j + (0.05 if p == "adaptive" and r == float("inf") else 0))
         for d in ("sharegpt", "humaneval") for r in (1.0, float("inf")) for j, p in enumerate(["off", "chain2", "adaptive"])])]
    phase = {"trace": "sharegpt:1:10,humaneval:1:10", "requests": 20,
             "segments": [{"dataset": "sharegpt", "rate": 1.0, "duration_s": 10.0},
                          {"dataset": "humaneval", "rate": 1.0, "duration_s": 10.0}],
             "segment_starts_s": [0.0, 10.0],
             "runs": {"off": {"segment_tpot_s": [0.1, 0.1]},
                      "adaptive": {"segment_tpot_s": [0.11, None], "timeline": runs[0]["result"]["telemetry"]["timeline"],
                                   "settle": [{"changes": 1, "settle_s": 2.0, "segment_s": 10.0, "configs": ["off"]},
                                              {"changes": 0, "settle_s": 0.0, "segment_s": 10.0, "configs": []}]}}}
    doc = {"command": "adaspec sweep ...", "settings": {"num_prompts": 4, "max_tokens": 8, "burstiness": 1.0, "seed": 0},
           "policies": {"off": "1+:off", "chain2": "1+:chain2", "adaptive": None},
           "machine": {"cpu": "x", "cores": 2, "memory_gib": 24, "platform": "linux", "loadavg_1_5_15": [1, 1, 1],
                       "date_utc": "now", "cpu_steal_fraction": 0.02},
           "runs": runs, "phase_change": phase, "notes": ["max_k raised"],
           "cross_check": {"rate": float("inf"), "policy": "off", "num_prompts": 4, "max_tokens": 8, "rounds": 1,
                           "adaspec_rounds": [{"output_throughput": 95.0}], "vllm_rounds": [{"output_throughput": 100.0}],
                           "adaspec_output_throughput": 95.0, "vllm_output_throughput": 100.0,
                           "adaspec_mean_tpot_s": 0.1, "vllm_mean_tpot_s": 0.1, "throughput_ratio": 0.95,
                           "within_10pct": True, "vllm_command": "python -c ..."}}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    report = write_report(tmp_path).read_text()
    for png in ("latency_vs_rate.png", "adaptive_k.png", "phase_change.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"({png})" in report
    assert "| inf | 100 / 150 / 10.0 |" in report
    assert "**missed** at" in report  # adaptive 0.17 vs oracle off 0.10 at inf
    assert "| sharegpt 1/s | 1 | 2.0 |" in report
    assert "ratio **0.950** (within 10%)" in report
    assert "CPU steal 2%" in report


def test_report_of_a_sweep_in_rounds_gives_intervals_and_held_out_oracle(tmp_path):
    rng = np.random.default_rng(0)
    center = {"off": 0.10, "chain2": 0.08, "adaptive": 0.08}
    runs = []
    for rnd in range(3):
        for d in ("sharegpt", "codeedit"):
            for p in ("off", "chain2", "adaptive"):
                run = _run(d, 1.0, p, center[p], len(runs))
                run.update(round=rnd, tpots_s=list(rng.normal(center[p], 0.01, 40)))
                runs.append(run)
    phase = {"trace": "sharegpt:1:10,codeedit:1:10", "requests": 40,
             "segments": [{"dataset": "sharegpt", "rate": 1.0, "duration_s": 10.0},
                          {"dataset": "codeedit", "rate": 1.0, "duration_s": 10.0}],
             "segment_starts_s": [0.0, 10.0],
             "runs": {p: {"segment_tpot_s": [c, c], "tpots_s": list(rng.normal(c, 0.01, 40))}
                      for p, c in (("off", 0.10), ("chain2", 0.09), ("adaptive", 0.06))}}
    phase["runs"]["adaptive"].update(timeline=[{"t": 0.0, "steps": 3, "mean_batch": 1.0, "mean_k": 2.0}],
                                     settle=[{"changes": 0, "settle_s": 0.0, "segment_s": 10.0, "configs": []}] * 2)
    doc = {"command": "adaspec sweep --rounds 3 ...",
           "settings": {"num_prompts": 40, "max_tokens": 64, "burstiness": 1.0, "seed": 0,
                        "request_mix": {"temperature": None, "top_p": 0.9, "greedy_share": 0.5, "ignore_eos": False}},
           "policies": {"off": "1+:off", "chain2": "1+:chain2", "adaptive": None},
           "machine": {"cpu": "x", "cores": 2, "memory_gib": 24, "platform": "linux", "loadavg_1_5_15": [1, 1, 1],
                       "date_utc": "now"},
           "runs": runs, "phase_change": phase, "notes": []}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    report = write_report(tmp_path).read_text()
    assert "## Verdicts with 95% intervals" in report and "realistic mix: 50% greedy" in report
    # The verdicts the report's sentences are made from (bench/verdicts.sweep_verdicts).
    v = json.loads((tmp_path / "verdicts-intervals.json").read_text())
    sharegpt = next(p for p in v["points"] if p["dataset"] == "sharegpt")
    # The oracle chosen on round 1, scored on rounds 2 and 3.
    assert sharegpt["oracle"] == "chain2" and sharegpt["selection_rounds"] == [0]
    assert sharegpt["scoring_rounds"] == [1, 2]
    assert v["goals"]["beats_every_static"] == "inconclusive"  # adaptive ties chain2
    assert v["goals"]["off_every_point"] == "met"
    assert v["vs_static_geomean"]["off"]["verdict"] == "met"
    for goal in v["goals"].values():
        assert f"**{goal}**" in report
    # The phase trace's one round: chain2 is the best static there and adaptive clears the goal.
    goal = phase_goal(phase)
    assert goal["best_static"] == "chain2" and goal["selection_rounds"] == goal["scoring_rounds"]
    assert goal["goal"] == 1.2 and goal["verdict"] == "met"
    assert f"`{goal['best_static']}`" in report


def test_phase_trace_alone_in_rounds_picks_the_best_static_on_held_out_rounds(tmp_path):
    """`adaspec sweep --rates none --phase-trace ... --rounds 2`: no grid, the phase-change
    section only; the best static policy is chosen on round 1 and scored on round 2, so a
    policy lucky in round 1 is the one adaptive is graded against."""
    rng = np.random.default_rng(1)
    centers = {"off": (0.100, 0.100), "chain2": (0.080, 0.110), "adaptive": (0.090, 0.050)}  # per round
    per_policy = {}
    for name, (c1, c2) in centers.items():
        rounds = [{"policy": name, "round": r, "requests": 40, "metrics": {}, "telemetry": {"mean_k": 1.0},
                   "segment_tpot_s": [c, None if r == 1 and name == "off" else c],
                   "tpots_s": list(rng.normal(c, 0.004, 40))} for r, c in enumerate((c1, c2))]
        if name == "adaptive":
            for r in rounds:
                r.update(timeline=[{"t": 0.0, "steps": 3, "mean_batch": 1.0, "mean_k": 2.0}], policy_changes=[],
                         settle=[{"changes": 0, "settle_s": 0.0, "segment_s": 10.0, "configs": []}] * 2)
        per_policy[name] = merge_rounds(rounds)
    assert per_policy["off"]["segment_tpot_s"] == [0.1, 0.1]  # a segment with no finished request is left out
    assert per_policy["chain2"]["segment_tpot_s"] == [pytest.approx(0.095)] * 2
    assert [len(r) for r in per_policy["adaptive"]["rounds_tpots_s"]] == [40, 40]
    phase = {"trace": "sharegpt:1:10,codeedit:1:10", "requests": 80, "rounds": 2,
             "segments": [{"dataset": "sharegpt", "rate": 1.0, "duration_s": 10.0},
                          {"dataset": "codeedit", "rate": 1.0, "duration_s": 10.0}],
             "segment_starts_s": [0.0, 10.0], "runs": per_policy}
    goal = phase_goal(phase)
    assert goal["best_static"] == "chain2" and goal["selection_rounds"] == [1] and goal["scoring_rounds"] == [2]
    assert goal["ratio"] == pytest.approx(0.110 / 0.050, rel=0.05) and goal["verdict"] == "met"
    # Round 2, from segment means (no per-request TPOTs kept): off (0.100) beats chain2 (0.110) in
    # segment 1 and has no request in segment 2.
    assert goal["ceiling"] == pytest.approx(0.110 / 0.105)
    doc = {"command": "adaspec sweep --rates none --phase-trace ...",
           "settings": {"num_prompts": 32, "max_tokens": 64, "burstiness": 1.0, "seed": 0},
           "policies": {"off": "1+:off", "chain2": "1+:chain2", "adaptive": None},
           "machine": {"cpu": "x", "cores": 2, "memory_gib": 24, "platform": "linux", "loadavg_1_5_15": [1, 1, 1],
                       "date_utc": "now"},
           "runs": [], "phase_change": phase, "notes": []}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    report = write_report(tmp_path).read_text()
    assert "## Verdicts" not in report and not (tmp_path / "latency_vs_rate.png").exists()
    # The ceiling the report states, from segment means (no per-request TPOTs kept), is under
    # the goal: out of reach for any policy switching among these statics.
    assert goal["ceiling_from_means"] and goal["ceiling"] < goal["goal"] == 1.2
    assert f"{goal['ceiling']:.3f}x `{goal['best_static']}`" in report
    assert (tmp_path / "phase_change.png").stat().st_size > 1000


def test_switching_ceiling_picks_each_segments_best_static_with_hindsight():
    """chain2 is the better policy over the whole trace, off the better one in its first
    segment: switching would have saved that segment's difference, and no more."""
    segments = {"off": [[[0.20, 0.20], [0.10] * 4], [[0.30], [0.10] * 4]],
                "chain2": [[[0.10, 0.10], [0.15] * 4], [[0.40], [0.05] * 4]]}
    # Round 1: chain2 pooled 0.8 over 6 requests; best per segment: chain2 (0.10 x 2), off (0.10 x 4).
    assert switching_ceiling(segments, "chain2", [0]) == pytest.approx((0.8 / 6) / (0.6 / 6))
    # Round 2: off is best in segment 1 (0.30 against 0.40), chain2 in segment 2.
    assert switching_ceiling(segments, "chain2", [1]) == pytest.approx((0.6 / 5) / (0.5 / 5))
    assert switching_ceiling({"off": segments["off"]}, "off", [0, 1]) == pytest.approx(1.0)
    # A segment the best static has no request in is left out.
    assert switching_ceiling({"off": [[[], [0.1]]], "chain2": [[[0.05], [0.2]]]}, "off", [0]) == pytest.approx(1.0)


# ---------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv, flag", [
    (["bench", "--dataset", "humaneval", "--rate", "0", "--num-prompts", "2"], "--rate"),
    (["bench", "--dataset", "humaneval", "--rate", "1", "--num-prompts", "500"], "--num-prompts"),
    (["bench", "--dataset", "humaneval", "--rate", "1", "--num-prompts", "2", "--url", "http://127.0.0.1:9"], "--url"),
    (["sweep", "--out", "x", "--rates", "1,fast"], "--rates"),
    (["sweep", "--out", "x", "--policies", "off,chain2x"], "--policies"),
    (["sweep", "--out", "x", "--dataset", "sharegpt,imagenet"], "--dataset"),
    (["sweep", "--out", "x", "--config", "nope.yaml"], "--config"),
    (["sweep", "--out", "x", "--phase-trace", "sharegpt:1"], "--phase-trace"),
    (["sweep", "--out", "x", "--rates", "none"], "--rates"),
    (["bench", "--dataset", "codeedit", "--rate", "1", "--num-prompts", "2", "--temperature", "-1"], "--temperature"),
    (["bench", "--dataset", "mixed", "--rate", "1", "--num-prompts", "2", "--top-p", "0"], "--top-p"),
    (["sweep", "--out", "x", "--greedy-share", "1.5"], "--greedy-share"),
    (["peer", "--out", "x", "--loads", "stream,fast"], "--loads"),
    (["peer", "--out", "x", "--peers", "vllm,sglang"], "--peers"),
    (["peer", "--out", "x", "--rounds", "0"], "--rounds"),
])
def test_cli_errors_name_the_flag(argv, flag, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("adaspec: error: ") and flag in err


# ---------------------------------------------------------------------------- real stack
@pytest.mark.slow
def test_adaspec_bench_against_the_server(server, client, tmp_path):
    """`adaspec bench` as a user runs it: a few streamed chat requests, realistic by default
    (stopping at EOS or the reply length); the JSON counts them, has no errors, and carries
    the replicas' telemetry. --ignore-eos makes every request run to --max-tokens."""
    from bench.harness import reply_token_caps

    cmd = [sys.executable, "-m", "cli.main", "bench", "--url", server.url, "--dataset", "sharegpt",
           "--rate", "4", "--num-prompts", "4", "--max-tokens", "12", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TPOT" in proc.stdout and "mean accepted length" in proc.stdout and "realistic mix" in proc.stdout
    assert "HTTP Request:" not in proc.stdout + proc.stderr  # no log line per request (httpx, httpx2)
    doc = json.loads(next(tmp_path.glob("bench-sharegpt-rate4*.json")).read_text())
    m, t = doc["metrics"], doc["telemetry"]
    assert (m["completed"], m["errors"]) == (4, 0)
    caps = dict(zip([p.id for p in load_prompts("sharegpt", 4, 0, split="test")],
                    reply_token_caps(load_prompts("sharegpt", 4, 0, split="test"), "smollm2-135m-instruct", 12)))
    assert all(0 < r["output_tokens"] <= caps[r["prompt_id"]] for r in doc["requests"]), (doc["requests"], caps)
    synthetic = subprocess.run(cmd[:-2] + ["--ignore-eos", "--json"], capture_output=True, text=True, timeout=300)
    assert synthetic.returncode == 0, synthetic.stderr[-3000:]
    assert json.loads(synthetic.stdout)["metrics"]["total_output_tokens"] == 4 * 12  # exactly max_tokens each
    assert m["tpot_s"]["mean"] > 0 and m["ttft_s"]["p99"] >= m["ttft_s"]["p50"] > 0
    assert t["available"] and t["steps"] > 0 and t["mean_k"] is not None and t["timeline"]
    assert "mean_accepted_length" in t and "acceptance_rate" in t


@pytest.mark.slow
def test_adaspec_profile_against_the_server(server, client, tmp_path):
    """`adaspec profile` as a user runs it: per (k, batch) cell, served requests of the asked
    dataset at once; the steps it saves ran each k at that batch, and the policy in force and
    the controller's state are given back afterwards."""
    from adaspec.telemetry import read_profile
    from testkit.clients import policy_of, push_policy, replica_status, set_controller

    was_paused = client.get("/admin/controller").json()["paused"]
    set_controller(client, "pause")  # held still, so the policy given back is the one pushed here
    try:
        push_policy(client, "1-2:chain2,3+:off")
        # 32 tokens: the three requests of a cell reach the engine over a few steps on a loaded
        # machine, and with 10 (5 steps under chain1) the first two could finish before the
        # third joined, leaving no step at batch 3 (seen once in the full suite).
        cmd = [sys.executable, "-m", "cli.main", "profile", "--url", server.url, "--ks", "0,1", "--batches", "1,3",
               "--max-tokens", "32", "--dataset", "codeedit", "--out", str(tmp_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((tmp_path / "profile.json").read_text())
        assert [(c["k"], c["batch"]) for c in summary["cells"]] == [(0, 1), (0, 3), (1, 1), (1, 3)]
        assert summary["dataset"] == "codeedit" and "realistic mix" in summary["requests"]
        model_id, steps = read_profile(str(tmp_path / "steps.jsonl"))
        assert model_id == "smollm2-135m-instruct"
        decode = [s for s in steps if s.num_decode_reqs and not s.prefill_tokens]
        assert {(str(s.config), s.batch_size) for s in decode} >= {("off", 1), ("off", 3), ("chain1", 1), ("chain1", 3)}
        assert any(s.num_drafts for s in decode if str(s.config) == "chain1")
        assert not any(s.num_drafts for s in decode if str(s.config) == "off")
        assert str(policy_of(replica_status(client)[0])) == "1-2:chain2,3+:off"
        assert client.get("/admin/controller").json()["paused"]
    finally:
        set_controller(client, "pause" if was_paused else "resume")


@pytest.mark.slow
def test_a_sweeps_adaptive_cell_starts_under_the_controllers_policy(server, client):
    """`adaspec sweep` resets the replicas to the start table before an adaptive cell; its
    load starts only once the controller's own policy is in force, as a static cell's starts
    under its table (the start table ran a burst's first steps before: docs/benchmarks.md)."""
    from bench.policies import apply_policy, resolve
    from serve_app import admin_client
    from testkit.clients import policy_of, replica_status, set_controller

    was_paused = client.get("/admin/controller").json()["paused"]
    # Never the controller's: its tables change config only between its batch buckets (1, 2,
    # 3-4, 5-8, ...), and this one changes at 5 | 6.
    start_table = "1-5:chain3,6+:chain2"
    try:
        static, adaptive = resolve(["chain1", "adaptive"], None)
        apply_policy(server.url, static, start_table)
        assert str(policy_of(replica_status(client)[0])) == "1+:chain1"
        apply_policy(server.url, adaptive, start_table)
        in_force = str(policy_of(replica_status(client)[0]))
        view = admin_client.controller_view(server.url)
        assert not view.paused
        assert [r.policy_in_force for r in view.replicas] == [r.chosen_policy for r in view.replicas] == [in_force]
        assert in_force != start_table
    finally:
        set_controller(client, "pause" if was_paused else "resume")


def test_summary_fits_one_screen_with_and_without_adaspec_telemetry():
    from bench.harness import BenchResult, BenchSettings, format_summary
    from bench.replica_probe import TelemetryTrace

    rs = [_req(0.0, 0.5, 1.4, 10, itl=[0.1] * 9)]
    settings = BenchSettings(url="http://x", dataset="sharegpt", rate=1.0, num_prompts=1)
    for trace in (TelemetryTrace(available=False, error="HTTP 404"),
                  trace_of({"r": [_step(0.5, 1, "chain2", drafts=2, accepted=(1, 0))]}, 0.0, ["1+:chain2"])):
        text = format_summary(BenchResult(settings=settings, model="m", started_at=0.0,
                                          metrics=summarize(rs, 2.0, 0.25), telemetry=trace))
        assert len(text.splitlines()) <= 12 and "TPOT" in text and "goodput" in text
        assert ("no adaspec telemetry" in text) != trace.available


def test_every_cli_flag_has_help():
    from cli.main import build_parser

    def parsers(parser):
        yield parser.prog, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    missing = [f"{prog} {a.option_strings or a.dest}" for prog, parser in parsers(build_parser())
               for a in parser._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not missing, f"flags without help text: {missing}"
