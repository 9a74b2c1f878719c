"""The peer benchmark's bookkeeping (bench/peer.py), no server: which processes it charges CPU
to, and its verdicts and report from a synthetic results file (made-up TPOTs whose answer is
known)."""

from __future__ import annotations

import json
import os
import random

import psutil

from bench.peer import ADAPTIVE_GOAL, PEER_GOAL, cpu_used, process_kind, serve_config, PeerSettings, verdicts, \
    vllm_command, write_report


def synthetic_doc(adaspec_off_tpot: float) -> dict:
    """Three rounds at two loads; plain vLLM at 100 ms, static ngram at 120 ms, adaspec at
    `off` at the given TPOT, chain4 as ngram, adaptive at 90 ms; each request's TPOT off by up
    to +-3% at random, differently for each peer."""
    rng = random.Random(0)
    tpots = {"vllm": 0.100, "vllm-ngram4": 0.120, "ray-serve-llm": 0.110, "adaspec:off": adaspec_off_tpot,
             "adaspec:chain4": 0.120, "adaspec:adaptive": 0.090}
    cells = []
    for r in range(3):
        for load in ("stream", "inf"):
            for peer, t in tpots.items():
                adaspec = peer.startswith("adaspec")
                cells.append({"round": r, "load": load, "peer": peer, "order": len(cells), "wall_s": 10.0,
                              "tpots_s": [t * rng.uniform(0.97, 1.03) for _ in range(8)],
                              "ttfts_s": [0.05] * 8, "output_tokens": 100, "errors": 0,
                              "norm_latency_s": [t * rng.uniform(0.97, 1.03) for _ in range(8)],
                              "cpu_s": {"VLLM::EngineCore": 3.0, "VLLM::Worker": 9.0},
                              "engine_steps": 50 if adaspec else 0, "engine_busy_s": 5.0 if adaspec else 0.0,
                              "engine_overhead_share": 0.002 * (1 + r) if adaspec else None})
    return {"command": "adaspec peer (synthetic)", "settings": {"loads": ["stream", "inf"], "k": 4, "rounds": 3,
                                                                "dataset": "sharegpt", "max_tokens": 64},
            "peers": list(tpots), "machine": {"cpu": "synthetic"}, "cells": cells}


def test_goals_are_met_or_missed_by_the_interval():
    by = {(v["load"], v["peer"], v["reference"]): v for v in verdicts(synthetic_doc(0.100))}
    same = by[("inf", "adaspec:off", "vllm")]
    assert same["goal"] == PEER_GOAL and same["metric"] == "norm_latency"
    assert same["norm_latency"]["low"] < 1.0 < same["norm_latency"]["high"]
    best = by[("stream", "adaspec:adaptive", "vllm")]  # the faster plain setting is the reference
    assert best["goal"] == ADAPTIVE_GOAL and best["verdict"] == "met" and 1.08 < best["norm_latency"]["ratio"] < 1.14
    slow = {(v["load"], v["peer"], v["reference"]): v for v in verdicts(synthetic_doc(0.150))}
    off = slow[("stream", "adaspec:off", "vllm")]
    assert off["verdict"] == "missed" and abs(off["norm_latency"]["ratio"] - 2 / 3) < 0.02
    assert abs(off["mean_tpot"]["ratio"] - 2 / 3) < 0.02


def test_runs_without_normalized_latency_are_judged_on_tpot():
    doc = synthetic_doc(0.150)
    for c in doc["cells"]:
        del c["norm_latency_s"]
    off = {(v["load"], v["peer"], v["reference"]): v for v in verdicts(doc)}[("stream", "adaspec:off", "vllm")]
    assert off["metric"] == "mean_tpot" and off["norm_latency"] is None and off["verdict"] == "missed"


def test_report_tables_every_peer_and_plots(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(synthetic_doc(0.100)))
    text = write_report(tmp_path)
    assert (tmp_path / "peer.png").stat().st_size > 10_000
    for peer in ("vllm", "vllm-ngram4", "ray-serve-llm", "adaspec:off", "adaspec:chain4", "adaspec:adaptive"):
        assert f"| {peer} |" in text
    assert "VLLM::Worker 90.0 ms" in text  # 9 CPU seconds per cell over 100 tokens
    assert "| adaspec:off | 0.40% (150 steps) | 0.40% (150 steps) |" in text  # 0.2, 0.4 and 0.6%, equal busy times


def test_cpu_is_charged_to_the_processes_that_serve():
    me = psutil.Process(os.getpid())
    assert process_kind(me) is None  # pytest is not a server
    before = {1: ("VLLM::Worker", 10.0), 2: ("raylet", 5.0)}
    after = {1: ("VLLM::Worker", 14.5), 2: ("raylet", 5.001), 3: ("gcs_server", 2.0)}  # 3 started in between
    assert cpu_used(before, after) == {"VLLM::Worker": 4.5}


def test_every_peer_gets_the_same_engine_settings(tmp_path):
    import yaml

    settings = PeerSettings(out=str(tmp_path))
    kwargs = {"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 32, "kv_cache_memory_bytes": 1 << 30}
    cmd = vllm_command("m", "/models/m", kwargs, 8101, ngram_k=4)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["num_speculative_tokens"] == 4
    doc = yaml.safe_load(serve_config(settings, "m", "/models/m", kwargs, tmp_path).read_text())
    adaspec_app, ray_app = doc["applications"]
    assert adaspec_app["args"]["max_model_len"] == 2048 and adaspec_app["args"]["max_num_seqs"] == 32
    assert adaspec_app["args"]["speculation"]["max_k"] >= 4 and adaspec_app["args"]["controller"]["enabled"]
    assert ray_app["import_path"] == "ray.serve.llm:build_openai_app" and ray_app["route_prefix"] == "/ray"
    assert ray_app["args"]["llm_configs"][0]["engine_kwargs"] == kwargs
