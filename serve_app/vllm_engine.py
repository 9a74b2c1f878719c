"""Ray Serve LLM's vLLM engine, plus the adaspec control channel into its scheduler.

The engine core runs `serve_app.vllm_scheduler.AdaspecScheduler` (set by the app builder
through `scheduler_cls`); this adapter reaches it with vLLM's utility-call mechanism, which
the scheduler module explains. vLLM's metrics carry Serve's tags (serve_app.metrics).
"""

from __future__ import annotations

from adaspec.engine_contract import EngineReport
from adaspec.policy import PolicyAck, SpecPolicy
from adaspec.telemetry import EngineCapabilities
from serve_app.metrics import ServeTaggedStatLogger
from serve_app.ray_llm import VLLMEngine

SCHEDULER_CLS = "serve_app.vllm_scheduler.AdaspecScheduler"


class AdaspecVLLMEngine(VLLMEngine):
    """VLLMEngine whose scheduler accepts policies and reports every step."""

    def _start_async_llm_engine(self, *args, **kwargs):
        """Ray Serve LLM's engine start, with vLLM's metrics tagged by Serve: Ray's code imports
        vLLM's `RayPrometheusStatLogger` by name when it builds the engine, so for that call
        the name is its subclass `ServeTaggedStatLogger` (the same series, plus deployment,
        application and replica)."""
        from vllm.v1.metrics import ray_wrappers

        original = ray_wrappers.RayPrometheusStatLogger
        ray_wrappers.RayPrometheusStatLogger = ServeTaggedStatLogger
        try:
            return super()._start_async_llm_engine(*args, **kwargs)
        finally:
            ray_wrappers.RayPrometheusStatLogger = original

    async def _call_scheduler(self, command: str, payload: str = "") -> str:
        if self._engine_client is None:
            raise RuntimeError("engine not started")
        return await self._engine_client.engine_core.call_utility_async("scheduler", command, payload)

    async def capabilities(self) -> EngineCapabilities:
        """What the scheduler was started with (asked once, after the engine starts)."""
        return EngineCapabilities.model_validate_json(await self._call_scheduler("capabilities"))

    async def apply_policy(self, policy: SpecPolicy) -> PolicyAck:
        """Install `policy`; it is in force from the next engine step on."""
        raw = await self._call_scheduler("apply_policy", policy.model_dump_json())
        return PolicyAck.model_validate_json(raw)

    async def drain_report(self) -> EngineReport:
        """Steps recorded since the previous drain, and the scheduler's load now."""
        return EngineReport.model_validate_json(await self._call_scheduler("drain"))
