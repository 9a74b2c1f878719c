"""The metrics' logic, without a running app (serve_app/metrics.py): vLLM's spec-decode counts
from adaspec's step records, and the Serve tags on vLLM's metric wrappers. Through the real
stack: tests/test_live_policy.py (a vLLM replica), tests/test_native_serving.py (a native
one), tests/test_cluster.py (the dashboard against a real Prometheus)."""

from __future__ import annotations

from adaspec.policy import SpecConfig
from adaspec.telemetry import StepRecord
from serve_app.metrics import (
    SERVE_TAG_KEYS, ReplicaMetrics, ServeCounter, ServeTaggedStatLogger, spec_decoding_stats,
)


def _step(drafted: list[int], accepted: list[int], num_drafts: int, nodes: list[int] | None = None) -> StepRecord:
    return StepRecord(time=0.0, duration_s=0.01, batch_size=num_drafts, num_decode_reqs=num_drafts,
                      scheduled_tokens=1, prefill_tokens=0, context_tokens=0, config=SpecConfig.chain(len(drafted)),
                      policy_version=1, num_drafts=num_drafts, draft_k=len(drafted), drafted_per_pos=drafted,
                      accepted_per_pos=accepted, nodes_per_seq=nodes or [])


def test_spec_decoding_stats_count_chains_per_position_and_trees_by_node():
    chain = _step(drafted=[2, 2, 2], accepted=[2, 1, 0], num_drafts=2)  # vLLM's engine: no nodes_per_seq
    tree = _step(drafted=[1, 1], accepted=[1, 1], num_drafts=1, nodes=[6])  # a 6-node tree, 2 deep
    off = _step(drafted=[], accepted=[], num_drafts=0)
    stats = spec_decoding_stats([chain, tree, off], max_k=4)
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 6 + 6
    assert stats.num_accepted_tokens == 3 + 2
    assert stats.num_accepted_tokens_per_pos == [3, 2, 0, 0]
    assert stats.num_draft_tokens_per_pos == [3, 3, 2, 0]


def test_vllm_wrappers_take_labels_by_position_and_add_serves_tags():
    counter = ServeCounter("vllm:test_counter", "a test", ["model_name", "engine"])
    assert counter.metric._tag_keys == ("model_name", "engine", "ReplicaId") + SERVE_TAG_KEYS
    labelled = counter.labels("m", "0")
    # Outside a Serve replica the tags are empty, never missing: Ray refuses a record whose
    # tags do not cover its keys.
    assert labelled._tags == {"model_name": "m", "engine": "0", "ReplicaId": "", "deployment": "",
                              "application": "", "replica": ""}
    labelled.inc(1)


def test_the_stat_logger_builds_every_vllm_series_with_the_tagged_wrappers():
    logger = ServeTaggedStatLogger
    assert {logger._gauge_cls.__name__, logger._counter_cls.__name__, logger._histogram_cls.__name__} == {
        "ServeGauge", "ServeCounter", "ServeHistogram"}
    for cls in (logger._spec_decoding_cls, logger._perf_metrics_cls):
        assert cls._counter_cls is ServeCounter
    assert logger._kv_connector_cls._histogram_cls is logger._histogram_cls


def test_the_engine_start_hands_ray_serve_llm_the_tagged_stat_logger(monkeypatch):
    """A fake of Ray Serve LLM's engine start (named so): it reads vLLM's stat logger by name
    at the call, as Ray's code does; the name is restored afterwards."""
    from vllm.v1.metrics import ray_wrappers

    from serve_app.ray_llm import VLLMEngine
    from serve_app.vllm_engine import AdaspecVLLMEngine

    original = ray_wrappers.RayPrometheusStatLogger
    seen = []
    monkeypatch.setattr(VLLMEngine, "_start_async_llm_engine",
                        lambda self, *a, **kw: seen.append(ray_wrappers.RayPrometheusStatLogger) or "client")
    assert AdaspecVLLMEngine._start_async_llm_engine(object.__new__(AdaspecVLLMEngine), None, None, None) == "client"
    assert seen == [ServeTaggedStatLogger]
    assert ray_wrappers.RayPrometheusStatLogger is original


def test_k_is_exported_at_fixed_batch_sizes_up_to_the_engines_max_batch():
    assert ReplicaMetrics("m", 48).batch_points == [1, 2, 4, 8, 16, 32, 48]
    assert ReplicaMetrics("m", 1).batch_points == [1]
