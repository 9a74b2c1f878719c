"""Ray Serve LLM's engine protocol (`LLMEngine`) over adaspec's native tree engine.

The replica deployment (serve_app.replica.SpecReplica, a ray.serve.llm LLMServer) calls an
engine's `chat` / `completions` with vLLM's OpenAI request models and streams back what
they yield; this adapter answers those calls with a `NativeEngine` running on its own
thread (serve_app.native_loop), so the ingress, the admin routes and the control plane are
the same for both engines. The control-plane calls the replica makes:
- `apply_policy(SpecPolicy) -> PolicyAck`: through the engine thread, in force next step;
- `drain_report() -> EngineReport`: the engine's records since the last drain, and load;
- `capabilities() -> EngineCapabilities`: trees supported (fixed when the engine starts).

A client that disconnects closes the response generator, which aborts its request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any, AsyncGenerator, Literal

from pydantic import BaseModel, ConfigDict, Field

from adaspec.engine_contract import EngineReport
from adaspec.policy import PolicyAck, SpecPolicy
from adaspec.telemetry import EngineCapabilities
from native_engine.requests import RequestOutput, SamplingParams
from serve_app import native_openai as oai
from serve_app.metrics import NativeEngineMetrics
from serve_app.native_loop import EngineLoop
from serve_app.ray_llm import LLMEngine

logger = logging.getLogger("ray.serve")


class NativeSettings(BaseModel):
    """What a replica needs to build its NativeEngine (from AppConfig, by the app builder)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str = Field(description="resolved safetensors folder of the target model")
    draft_model_path: str | None = Field(default=None, description="draft model folder (draft_model only)")
    draft_method: Literal["ngram", "draft_model"]
    max_k: int = Field(description="deepest tree or chain the drafter builds (tokens)")
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    policy: str = Field(description="policy at start")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="float32", description="auto: the faster on this machine, measured once (native_engine/dtype_choice.py)")
    device: str = "cpu"
    max_batch_size: int = Field(description="KV-cache rows: the largest running batch (requests)")
    max_model_len: int = Field(description="context window a request may use: prompt + output (tokens)")
    max_tree_nodes: int = Field(default=64, description="draft nodes per sequence per step, at most")
    tree_budget: int | None = None
    compile_decode: bool = Field(default=False, description="compile the one-token decode pass and batch-1 verify passes at start")
    compile_autotune: bool = Field(default=False, description="compile_decode also autotunes inductor's GEMM templates")
    torch_threads: int = Field(default_factory=lambda: os.cpu_count() or 1)


def build_engine(s: NativeSettings):
    """The NativeEngine for `s` (weights loaded; runs on whichever thread calls it)."""
    from native_engine import dtype_choice
    from native_engine.drafters import DraftModelDrafter, NgramDrafter
    from native_engine.engine import EngineConfig, NativeEngine
    from native_engine.model import load_model

    if s.dtype == "auto":
        choice = dtype_choice.choose(s.model_path, s.device)
        logger.info("adaspec: dtype auto: %s", choice)
        dtype = choice.dtype
    else:
        dtype = dtype_choice.DTYPES[s.dtype]
        if s.dtype == "bfloat16" and s.device == "cpu" and not dtype_choice.cpu_has_bf16():
            # Emulated there: several times slower than float32, and greedy output under
            # speculation may differ from greedy without it (docs/native-engine.md, bf16).
            logger.warning("adaspec: dtype bfloat16 on a CPU without native bfloat16 (no AVX512-BF16 / AMX): "
                           "slower than float32, and greedy speculation is not token-exact here; "
                           "dtype: auto would pick float32")
    # The cache row holds the context window plus one verify tree beyond it.
    config = EngineConfig(max_batch_size=s.max_batch_size, max_seq_len=s.max_model_len + s.max_tree_nodes + 1,
                          max_tree_nodes=s.max_tree_nodes, tree_budget=s.tree_budget)
    if s.draft_method == "ngram":
        drafter = NgramDrafter(max_n=s.prompt_lookup_max, min_n=s.prompt_lookup_min, max_depth=s.max_k)
    else:
        small = load_model(s.draft_model_path, dtype=dtype, device=s.device).prepare_for_serving()
        drafter = DraftModelDrafter(small, config.max_batch_size, config.max_seq_len, max_depth=s.max_k)
    return NativeEngine.from_pretrained(s.model_path, drafter=drafter, dtype=dtype, device=s.device,
                                        config=config, policy=SpecPolicy.parse(s.policy, version=0))


class AdaspecNativeEngine(LLMEngine):
    """LLMEngine whose requests run on a NativeEngine thread; policies and telemetry too."""

    def __init__(self, llm_config, settings: NativeSettings):
        self.llm_config = llm_config
        self.settings = settings
        self.model_id = llm_config.model_id
        self._loop: EngineLoop | None = None
        self._caps: EngineCapabilities | None = None
        self._metrics: NativeEngineMetrics | None = None
        self._ids = itertools.count()

    async def start(self) -> None:
        from transformers import AutoTokenizer

        engine = await asyncio.to_thread(build_engine, self.settings)  # seconds of weight loading
        self._caps = engine.capabilities()
        self._metrics = NativeEngineMetrics(self.model_id, self._caps.max_k)
        # The HF tokenizer for chat templates and prompts; the engine's own (same
        # tokenizer.json) for output text and stop strings.
        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.model_path)
        self._loop = EngineLoop(engine, self.settings.torch_threads)
        self._loop.start()
        if self.settings.compile_decode:  # on the engine thread: inductor's kernels take its thread count
            try:
                autotune = self.settings.compile_autotune
                seconds = await asyncio.wrap_future(self._loop.call(lambda e: e.compile_decode(autotune)))
            except Exception as e:  # inductor's own error is long; say which setting to change
                raise RuntimeError(f"compile_decode: torch.compile failed ({type(e).__name__}: "
                                   f"{str(e)[:500]}); set compile_decode: false to serve eagerly") from e
            logger.info("adaspec: decode pass compiled in %.0f s", seconds)
        if self._caps.supports_budgets:  # the controller may choose per-request budgets at any time
            # On the engine thread: the cache key holds its torch threads.
            seconds, loaded = await asyncio.wrap_future(self._loop.call(lambda e: e.load_or_calibrate_step_cost()))
            logger.info("adaspec: per-request budgets' step cost %s in %.1f s",
                        "loaded from the cache" if loaded else "calibrated", seconds)
        dtype = str(engine.model.lm_head.weight.dtype).removeprefix("torch.")
        logger.info("adaspec: native engine started: %s, %s drafter (max depth %d), %d rows x %d tokens, policy %s, "
                    "matmuls: %s, decode attention: %s", dtype, self._caps.draft_method, self._caps.max_k,
                    self.settings.max_batch_size, self.settings.max_model_len, engine.policy,
                    engine.model.linear_choice or "one path",
                    "adaspec's kernel" if engine.model.uses_decode_kernel() else "torch's")

    # ------------------------------------------------------------------ control plane
    async def capabilities(self) -> EngineCapabilities:
        assert self._caps is not None, "engine not started"
        return self._caps

    async def apply_policy(self, policy: SpecPolicy) -> PolicyAck:
        """Install `policy` between two steps; the engine validates it (trees included)."""
        return await asyncio.wrap_future(self._loop.call(lambda e: e.apply_policy(policy)))

    async def drain_report(self) -> EngineReport:
        """The steps since the last drain (every step passes here once: the metrics count it)."""
        report = await asyncio.wrap_future(self._loop.call(lambda e: e.drain()))
        self._metrics.observe_report(report)
        return report

    async def check_health(self) -> None:
        if self._loop is None or not self._loop.healthy:
            raise RuntimeError("native engine thread is not running")

    async def shutdown(self) -> None:
        if self._loop is not None:
            await asyncio.to_thread(self._loop.stop)

    # ------------------------------------------------------------------ OpenAI calls
    async def completions(self, request, raw_request_info=None) -> AsyncGenerator[Any, None]:
        async for item in self._serve(request, chat=False):
            yield item

    async def chat(self, request, raw_request_info=None) -> AsyncGenerator[Any, None]:
        async for item in self._serve(request, chat=True):
            yield item

    async def _serve(self, request, chat: bool) -> AsyncGenerator[Any, None]:
        try:
            prompt = (oai.chat_prompt if chat else oai.completion_prompt)(request, self.tokenizer)
            params = oai.sampling_params(request, len(prompt), self.settings.max_model_len)
        except oai.BadRequest as e:
            yield oai.error_response(str(e))
            return
        arrival = time.monotonic()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{request.request_id}-{next(self._ids)}"
        try:  # before anything is yielded: a refusal must be the stream's first (and only) item
            inbox = await self._submit(request_id, prompt, params)
        except ValueError as e:  # the engine refused it (e.g. too long for its cache)
            yield oai.error_response(str(e))
            return
        result = oai.Result(request_id, request.model or self.model_id, int(time.time()), len(prompt))
        outputs = self._outputs(request_id, inbox, arrival, len(prompt))
        try:
            if request.stream:
                async for chunk in self._stream(outputs, result, params, chat, request):
                    yield chunk
            else:
                async for out in outputs:
                    result.text, result.finish_reason = out.text or "", out.finish_reason
                    result.completion_tokens = out.num_output_tokens
                yield oai.chat_response(result) if chat else oai.completion_response(result)
        finally:
            await outputs.aclose()  # aborts the request if it is still running

    async def _stream(self, outputs, result: oai.Result, params: SamplingParams, chat: bool, request):
        from vllm.entrypoints.generate.base.protocol import DeltaMessage

        text = oai.IncrementalText(params.stop)
        if chat:  # OpenAI's first chunk names the role
            yield oai.sse(oai.chat_chunk(result, DeltaMessage(role="assistant", content="")))
        async for out in outputs:
            result.completion_tokens = out.num_output_tokens
            delta = text.delta(out.text or "", out.finished)
            finish = out.finish_reason if out.finished else None
            if delta or finish:
                chunk = (oai.chat_chunk(result, DeltaMessage(content=delta), finish) if chat
                         else oai.completion_chunk(result, delta, finish))
                yield oai.sse(chunk)
        if request.stream_options and request.stream_options.include_usage:
            yield oai.sse(oai.usage_chunk(result, chat))
        yield oai.SSE_DONE

    async def _submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        """Add the request on the engine thread; its outputs will arrive in the returned queue."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        sink = lambda out: loop.call_soon_threadsafe(inbox.put_nowait, out)  # noqa: E731 - engine thread
        await asyncio.wrap_future(self._loop.submit(request_id, prompt, params, sink))
        return inbox

    async def _outputs(self, request_id: str, inbox: asyncio.Queue, arrival: float,
                       prompt_tokens: int) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs (several steps' coalesced into the latest) until it
        finishes. Closing this generator early aborts the request. A finished request's
        latencies go to the metrics (`arrival`: monotonic seconds)."""
        finished, first_token = False, None
        try:
            while not finished:
                out = await inbox.get()
                while not inbox.empty() and not _is_final(out):
                    out = inbox.get_nowait()
                if isinstance(out, BaseException):
                    raise RuntimeError(f"native engine failed: {out!r}")
                finished = out.finished
                if first_token is None and out.num_output_tokens:
                    first_token = time.monotonic()
                if finished:
                    self._metrics.observe_request(arrival, first_token, time.monotonic(), prompt_tokens,
                                                  out.num_output_tokens)
                yield out
        finally:
            if not finished:  # the client went away (or the stream was cancelled)
                self._loop.abort(request_id)

    # ------------------------------------------------------------------ not offered
    async def embeddings(self, request, raw_request_info=None):
        yield oai.error_response("embeddings: not served by engine native", 404, "NotFoundError")

    async def transcriptions(self, request, raw_request_info=None):
        yield oai.error_response("transcriptions: not served by engine native", 404, "NotFoundError")

    async def resolve_lora(self, lora_model) -> None:
        raise ValueError("engine native does not serve LoRA adapters")

    async def reset_prefix_cache(self) -> None:
        pass  # no prefix cache

    def routing_stats(self) -> dict:
        return {}


def _is_final(out) -> bool:
    return isinstance(out, BaseException) or out.finished
