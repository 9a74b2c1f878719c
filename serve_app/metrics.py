"""A replica's Prometheus metrics, in the field's shape (exported through Ray's metrics agent,
which prefixes every name with `ray_`).

- vLLM's own metrics (`vllm:*`: requests running and waiting, TTFT, TPOT, spec-decode drafts,
  draft tokens, accepted tokens and accepted tokens per position), labelled `model_name` and
  `engine` as vLLM labels them, plus Serve's `deployment`, `application` and `replica` tags,
  as Serve's own metrics carry them (vLLM's Ray wrappers add only `ReplicaId`):
  - a vLLM engine: vLLM's stat logger itself (`ServeTaggedStatLogger`, Ray Serve LLM's
    `RayPrometheusStatLogger` with the tags);
  - the native engine: `NativeEngineMetrics`, the same names, buckets and labels, spec-decode
    counted by vLLM's own `SpecDecodingProm`, so one dashboard reads both engines.
- adaspec's own (`ReplicaMetrics`, both engines): k in force per batch size, the policy
  version, engine step seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve import metrics as serve_metrics
from vllm.v1.metrics.buckets import histogram_buckets
from vllm.v1.metrics.ray_wrappers import (
    RayCounterWrapper, RayGaugeWrapper, RayHistogramWrapper, RayKVConnectorProm, RayPerfMetricsProm,
    RayPrometheusMetric, RayPrometheusStatLogger, RaySpecDecodingProm,
)
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from adaspec.engine_contract import EngineReport
from adaspec.telemetry import StepRecord

SERVE_TAG_KEYS = ("deployment", "application", "replica")
VLLM_LABELS = ["model_name", "engine"]  # vLLM's labels of its per-engine series


def serve_tags() -> dict[str, str]:
    """Serve's tags of the replica this runs in, as ray.serve.metrics sets them (empty outside one)."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # not in a Serve replica (a unit test)
        return dict.fromkeys(SERVE_TAG_KEYS, "")
    return {"deployment": ctx.deployment, "application": ctx.app_name, "replica": ctx.replica_tag}


class _ServeTagged(RayPrometheusMetric):
    """vLLM's Ray metric wrapper, tagged with Serve's deployment, application and replica."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tags.update(serve_tags())

    @staticmethod
    def _get_tag_keys(labelnames: list[str] | None) -> tuple[str, ...]:
        return RayPrometheusMetric._get_tag_keys(labelnames) + SERVE_TAG_KEYS

    def _build_tags(self, *labels: Any, **labelskwargs: Any) -> dict[str, str]:
        # vLLM passes label values by position, in its labelnames' order (the first tag keys);
        # the base class counts them against every tag key but ReplicaId, so name them here.
        labelskwargs.update(zip(self.metric._tag_keys, labels))
        return {**super()._build_tags(**labelskwargs), **serve_tags()}


class ServeCounter(_ServeTagged, RayCounterWrapper):
    pass


class ServeGauge(_ServeTagged, RayGaugeWrapper):
    pass


class ServeHistogram(_ServeTagged, RayHistogramWrapper):
    pass


class ServeTaggedSpecDecodingProm(RaySpecDecodingProm):
    _counter_cls = ServeCounter


class ServeTaggedKVConnectorProm(RayKVConnectorProm):
    _gauge_cls, _counter_cls, _histogram_cls = ServeGauge, ServeCounter, ServeHistogram


class ServeTaggedPerfMetricsProm(RayPerfMetricsProm):
    _counter_cls = ServeCounter


class ServeTaggedStatLogger(RayPrometheusStatLogger):
    """Ray Serve LLM's vLLM stat logger, every series tagged with Serve's tags."""

    _gauge_cls, _counter_cls, _histogram_cls = ServeGauge, ServeCounter, ServeHistogram
    _spec_decoding_cls = ServeTaggedSpecDecodingProm
    _kv_connector_cls = ServeTaggedKVConnectorProm
    _perf_metrics_cls = ServeTaggedPerfMetricsProm


@dataclass(frozen=True)
class _SpeculationDepth:
    """What vLLM's SpecDecodingProm reads of its SpeculativeConfig: positions to count."""

    num_speculative_tokens: int


def spec_decoding_stats(steps: list[StepRecord], max_k: int) -> SpecDecodingStats:
    """vLLM's spec-decode counts for these steps. A tree's draft tokens are its nodes; a
    position counts a sequence whose draft was accepted up to it (vLLM's terms)."""
    stats = SpecDecodingStats.new(max_k)
    for step in steps:
        stats.num_drafts += step.num_drafts
        stats.num_draft_tokens += sum(step.nodes_per_seq) if step.nodes_per_seq else sum(step.drafted_per_pos)
        for pos, n in enumerate(step.accepted_per_pos[:max_k]):
            stats.num_accepted_tokens += n
            stats.num_accepted_tokens_per_pos[pos] += n
        for pos, n in enumerate(step.drafted_per_pos[:max_k]):
            stats.num_draft_tokens_per_pos[pos] += n
    return stats


class NativeEngineMetrics:
    """vLLM's serving metrics for the native engine, by vLLM's names, buckets and labels."""

    def __init__(self, model_name: str, max_k: int):
        values = [model_name, "0"]  # one engine per replica: vLLM's engine index 0
        self.max_k = max_k
        self.spec = ServeTaggedSpecDecodingProm(_SpeculationDepth(max_k) if max_k else None, VLLM_LABELS, {0: values})
        self.running = ServeGauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                  VLLM_LABELS).labels(*values)
        self.waiting = ServeGauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                  VLLM_LABELS).labels(*values)
        self.ttft = ServeHistogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   VLLM_LABELS, histogram_buckets("time_to_first_token")).labels(*values)
        self.tpot = ServeHistogram("vllm:request_time_per_output_token_seconds",
                                   "Histogram of time_per_output_token_seconds per request.", VLLM_LABELS,
                                   histogram_buckets("inter_token_latency")).labels(*values)
        self.e2e = ServeHistogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  VLLM_LABELS, histogram_buckets("request_latency")).labels(*values)
        self.prompt_tokens = ServeCounter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                          VLLM_LABELS).labels(*values)
        self.generation_tokens = ServeCounter("vllm:generation_tokens", "Number of generation tokens processed.",
                                              VLLM_LABELS).labels(*values)

    def observe_report(self, report: EngineReport) -> None:
        self.running.set(report.running)
        self.waiting.set(report.waiting)
        if self.max_k and report.steps:
            self.spec.observe(spec_decoding_stats(report.steps, self.max_k))

    def observe_request(self, arrival: float, first_token: float | None, finish: float, prompt_tokens: int,
                        output_tokens: int) -> None:
        """A finished request (monotonic seconds). TPOT as vLLM defines it: the decode time
        over the tokens after the first."""
        self.e2e.observe(finish - arrival)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.observe((finish - first_token) / (output_tokens - 1))


# Batch sizes the k in force is exported at (up to the engine's max batch): the policy's rule
# boundaries move, fixed points keep one series each.
K_BATCH_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ReplicaMetrics:
    """adaspec's own series of a replica, both engines (Serve's tags added by ray.serve.metrics)."""

    def __init__(self, model_name: str, max_batch_size: int):
        tags = {"model_name": model_name}
        self.batch_points = [b for b in K_BATCH_POINTS if b < max_batch_size] + [max_batch_size]
        self.k_in_force = serve_metrics.Gauge(
            "adaspec_spec_k", "draft tokens per step in force at a batch size (0: off; a tree's depth)",
            tag_keys=("model_name", "batch"))
        self.policy_version = serve_metrics.Gauge("adaspec_policy_version", "policy version in force",
                                                  tag_keys=("model_name",))
        self.step_time = serve_metrics.Histogram(
            "adaspec_step_seconds", "engine step duration (seconds)",
            boundaries=[0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5], tag_keys=("model_name",))
        for m in (self.k_in_force, self.policy_version, self.step_time):
            m.set_default_tags(dict(tags))  # a copy each: Serve adds its own tags to the dict it gets
        self._version: int | None = None  # the policy version the gauges show

    def observe(self, report: EngineReport) -> None:
        """A drain of the engine (every poll): its steps, and the policy's gauges when it changed."""
        for step in report.steps:
            self.step_time.observe(step.duration_s)
        if report.policy.version != self._version:
            for batch in self.batch_points:
                self.k_in_force.set(report.policy.config_for(batch).depth, tags={"batch": str(batch)})
            self.policy_version.set(report.policy.version)
            self._version = report.policy.version
