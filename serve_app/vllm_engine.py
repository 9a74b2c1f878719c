"""Ray Serve LLM's vLLM engine, plus the adaspec control channel into its scheduler.

The engine core runs `serve_app.vllm_scheduler.AdaspecScheduler` (set by the app builder
through `scheduler_cls`); this adapter reaches it with vLLM's utility-call mechanism, which
the scheduler module explains.
"""

from __future__ import annotations

from adaspec.policy import PolicyAck, SpecPolicy
from adaspec.telemetry import EngineCapabilities
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from serve_app.vllm_scheduler import EngineCoreReport

SCHEDULER_CLS = "serve_app.vllm_scheduler.AdaspecScheduler"


class AdaspecVLLMEngine(VLLMEngine):
    """VLLMEngine whose scheduler accepts policies and reports every step."""

    async def _call_scheduler(self, command: str, payload: str = "") -> str:
        if self._engine_client is None:
            raise RuntimeError("engine not started")
        return await self._engine_client.engine_core.call_utility_async("scheduler", command, payload)

    async def apply_policy(self, policy: SpecPolicy) -> PolicyAck:
        """Install `policy`; it is in force from the next engine step on."""
        raw = await self._call_scheduler("apply_policy", policy.model_dump_json())
        return PolicyAck.model_validate_json(raw)

    async def drain_report(self) -> EngineCoreReport:
        """Steps recorded since the previous drain, and the scheduler's load now."""
        return EngineCoreReport.model_validate_json(await self._call_scheduler("drain"))

    def capabilities(self, report: EngineCoreReport) -> EngineCapabilities:
        """vLLM speculates in chains only, up to the k it was started with."""
        method = self.llm_config.engine_kwargs["speculative_config"]["method"]
        return EngineCapabilities(engine="vllm", max_batch_size=report.max_batch_size, max_k=report.max_k,
                                  supports_trees=False, draft_method=method)
