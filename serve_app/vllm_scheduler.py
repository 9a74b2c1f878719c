"""A vLLM scheduler that takes live speculation policies and records every step.

It runs inside vLLM's engine-core process (passed as `scheduler_cls`). vLLM 0.32 decides the
speculation length of a step from `Scheduler.dynamic_sd_lookup`, a dense list
batch size -> k built once from `num_speculative_tokens_per_batch_size`. We replace that
list when a policy arrives, so a policy costs nothing per step.

The start policy is not vLLM's table: the app builder starts vLLM with a table that holds
every k of 0..max_k, so that vLLM captures CUDA graphs for each (serve_app/vllm_cudagraphs.py),
and passes the configured start policy in the environment (START_POLICY_ENV), which the
scheduler installs in place of vLLM's lookup before the first step. A vLLM engine started by
hand without it starts from its table, as before.

The channel: EngineCore dispatches a utility call by attribute name,
`getattr(engine_core, name)(*args)`, between two steps, in the engine loop's own thread.
The engine core's attribute `scheduler` is this object, so a utility call named
"scheduler" lands in `__call__` below. A policy applied by a call that has returned is
therefore in force from the next scheduled step on, with no lock and no polling.

Two variants, one logic (`AdaspecMixin`): vLLM has two schedulers and picks one from
`scheduler_config.async_scheduling`, which it resolves itself (on by default on CUDA for
draft_model, EAGLE, MTP and ngram_gpu; forced off on CPU). Under async scheduling the engine
schedules step N+1 before step N's output is back, so the drafts step N+1 verifies do not
exist yet: only `AsyncScheduler` schedules placeholders for them (the worker fills them in).
The synchronous `Scheduler` under async scheduling schedules no draft for verification at
all, with no error. So `AdaspecScheduler`, the name the app passes as `scheduler_cls`, is a
factory: vLLM constructs it after resolving the setting, and it returns
`AdaspecAsyncScheduler` or `AdaspecSyncScheduler` to match. Each variant refuses to start
under the other mode.

Step timing: a step runs schedule() -> model forward (draft + verify) -> update_from_output().
Under async scheduling two steps are in flight (step N+1's schedule() runs before step N's
update_from_output()), so a step is measured from the later of its schedule() start and the
previous step's update_from_output() end, to its own update_from_output() end: step times
never overlap and add up to the engine's busy time. Under sync scheduling this is the time
from schedule() to update_from_output().

Shadow acceptance (n-gram drafter only): after each step's output, serve_app/ngram_shadow.py
replays vLLM's n-gram matching on every running request's history for k = max_k and scores
it against the tokens produced since, whatever k is in force (`off` included); the step
record carries the settled counts (StepRecord.shadow_*).
"""

from __future__ import annotations

import contextlib
import os
import time

from adaspec.engine_contract import PolicySlot
from adaspec.policy import OPEN_END, PolicyRule, SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, RequestLifetimes, StepRecord
from serve_app.ngram_shadow import SHADOW_SOURCE, NgramShadow
from serve_app.vllm_cudagraphs import START_POLICY_ENV, capture_table
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

SCHEDULER_PATH = "serve_app.vllm_scheduler.AdaspecScheduler"


def _policy_from_vllm_table(table: list, version: int = 0) -> SpecPolicy:
    """The SpecPolicy equivalent of vLLM's [[lo, hi, k], ...] start-up table."""
    rules = []
    for i, (lo, hi, k) in enumerate(table):
        last = i == len(table) - 1
        rules.append(PolicyRule(batch_lo=lo, batch_hi=OPEN_END if last else hi, config=SpecConfig.chain(k)))
    return SpecPolicy(version=version, rules=tuple(rules))


class AdaspecMixin:
    """A live policy and a per-step telemetry buffer (a PolicySlot), over one of vLLM's
    schedulers. A variant sets ASYNC to the `scheduler_config.async_scheduling` it is for."""

    ASYNC: bool

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        resolved = bool(self.scheduler_config.async_scheduling)
        if resolved != self.ASYNC:
            other = AdaspecAsyncScheduler if resolved else AdaspecSyncScheduler
            raise RuntimeError(
                f"{type(self).__name__} runs with scheduler_config.async_scheduling={self.ASYNC}, but vLLM "
                f"resolved it to {resolved}; use {other.__name__}, or {SCHEDULER_PATH}, which picks the variant"
            )
        spec = self.vllm_config.speculative_config
        if spec is None or self.dynamic_sd_lookup is None:
            raise RuntimeError(
                "AdaspecScheduler needs speculative_config.num_speculative_tokens_per_batch_size"
            )
        # vLLM speculates in chains only, up to the k it was started with.
        capabilities = EngineCapabilities(engine="vllm", max_batch_size=self.scheduler_config.max_num_seqs,
                                          max_k=self.num_spec_tokens, supports_trees=False,
                                          draft_method=spec.method, accelerator=self._accelerator())
        self._slot = PolicySlot(capabilities, self._start_policy(spec.num_speculative_tokens_per_batch_size))
        self.dynamic_sd_lookup = [c.depth for c in self._slot.table]
        # id(scheduler_output) -> (schedule() start, its record, its output): up to two steps in
        # flight under async scheduling. The output is kept for the rejected-draft correction.
        self._pending: dict[int, tuple[float, StepRecord, object]] = {}
        self._step_spec_stats = None
        self._prev_k = 0  # k decided by the previous scheduled step: what the next one verifies
        self._clock = time.perf_counter  # tests inject their own
        self._last_update_end = float("-inf")  # clock at the end of the previous update_from_output
        self._lifetimes = RequestLifetimes()
        self._shadow = NgramShadow.for_vllm(self.vllm_config)  # None unless the drafter is method: ngram
        self._overhead_s = 0.0  # seconds in this class's own code since the last step record

    def _accelerator(self) -> str:
        """vLLM's name of the device ('cpu' on CPU), with the tensor-parallel device count."""
        from vllm.platforms import current_platform

        tp = self.vllm_config.parallel_config.tensor_parallel_size
        return current_platform.get_device_name() + (f" x{tp}" if tp > 1 else "")

    def _start_policy(self, vllm_table: list) -> SpecPolicy:
        """The configured start policy (START_POLICY_ENV), in the form vLLM's table would give it
        (clipped to max_num_seqs, the last rule open-ended); else vLLM's table itself."""
        text = os.environ.get(START_POLICY_ENV)
        max_batch = self.scheduler_config.max_num_seqs
        if text:
            return _policy_from_vllm_table(SpecPolicy.parse(text).to_vllm_table(max_batch))
        if [list(row) for row in vllm_table] == capture_table(max_batch, self.num_spec_tokens):
            # The app's capture table without the policy meant to replace it: running it would
            # serve a policy nobody chose (chain max_k at batch 1, one less at batch 2, ...).
            raise RuntimeError(f"AdaspecScheduler: vLLM was started with adaspec's CUDA-graph capture table but "
                               f"{START_POLICY_ENV} (the start policy) is not set in the engine's environment")
        return _policy_from_vllm_table(vllm_table)

    # ------------------------------------------------------------------ control channel
    def __bool__(self) -> bool:  # EngineCore evaluates `getattr(...) and call(...)`
        return True

    def __call__(self, command: str, payload: str = "") -> str:
        """Utility-call entry point: `apply_policy` (SpecPolicy JSON), `drain` or `capabilities`."""
        if command == "apply_policy":
            try:
                policy = SpecPolicy.model_validate_json(payload)
            except ValueError as e:  # pydantic's ValidationError
                return self._slot.reject(f"not a SpecPolicy: {e}").model_dump_json()
            ack = self._slot.apply(policy)
            if ack.status == "applied":
                self.dynamic_sd_lookup = [c.depth for c in self._slot.table]
            return ack.model_dump_json()
        if command == "drain":
            with self._own_work():
                running, waiting = self.get_request_counts()
                return self._slot.drain(waiting=waiting, running=running).model_dump_json()
        if command == "capabilities":
            return self._slot.capabilities.model_dump_json()
        raise ValueError(f"unknown adaspec scheduler command {command!r}")

    # ------------------------------------------------------------------ step recording
    @contextlib.contextmanager
    def _own_work(self):
        """Counts the time inside in StepRecord.overhead_s (of the next record)."""
        start = self._clock()
        try:
            yield
        finally:
            self._overhead_s += self._clock() - start

    def schedule(self, *args, **kwargs):
        start = self._clock()
        output = super().schedule(*args, **kwargs)
        with self._own_work():
            self._record_schedule(start, output)
        return output

    def _record_schedule(self, start: float, output) -> None:
        num_scheduled = output.num_scheduled_tokens  # req_id -> tokens this step
        batch = len(num_scheduled)
        if batch == 0:
            return
        spec_tokens = output.scheduled_spec_decode_tokens  # req_id -> draft token ids (-1: placeholder)
        decode = prefill = context = 0
        for req_id, n_tokens in num_scheduled.items():
            request = self.requests[req_id]
            # schedule() has already advanced num_computed_tokens by this step's tokens. Under
            # async scheduling it also counts the previous step's tokens still in flight (its
            # sampled token and drafts, as placeholders), so a decode's `before` is past the
            # prompt there too; the drafts it rejects are taken off in update_from_output.
            before = request.num_computed_tokens - n_tokens
            context += before
            if before >= request.num_prompt_tokens and n_tokens == 1 + len(spec_tokens.get(req_id, ())):
                decode += 1
            else:
                prefill += n_tokens
        record = StepRecord(
            time=0.0, duration_s=0.0, batch_size=batch, num_decode_reqs=decode,
            scheduled_tokens=output.total_num_scheduled_tokens, prefill_tokens=prefill,
            context_tokens=context, config=self._slot.config_for(batch),
            policy_version=self._slot.policy.version, draft_k=self._prev_k,
        )
        self._prev_k = output.num_spec_tokens_to_schedule
        self._pending[id(output)] = (start, record, output)
        self._lifetimes.step(num_scheduled, batch, record.config)

    def _free_request(self, request, *args, **kwargs):
        with self._own_work():
            self._record_finished(request)
        return super()._free_request(request, *args, **kwargs)

    def _record_finished(self, request) -> None:
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if self._shadow is not None:
            self._shadow.finish(request.request_id, None if aborted else request.all_token_ids)
        if aborted:
            self._lifetimes.discard(request.request_id)
        else:
            record = self._lifetimes.finish(request.request_id, request.arrival_time,
                                            request.num_prompt_tokens, request.num_output_tokens)
            if record is not None:
                self._slot.record_request(record)

    def make_stats(self, spec_decoding_stats=None, *args, **kwargs):
        # update_from_output calls this once, at its end, with the SpecDecodingStats of the
        # step it is updating (the engine's own calls outside a step pass none).
        self._step_spec_stats = spec_decoding_stats
        return super().make_stats(spec_decoding_stats, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        self._step_spec_stats = None
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        hook_start = self._clock()
        if self._shadow is not None:
            # The requests that finished in this step were settled in _free_request.
            self._shadow.observe_step(scheduler_output.num_scheduled_tokens, self.requests)
        now = self._clock()
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is not None:
            start, record, _ = pending
            record.duration_s = now - max(start, self._last_update_end)
            record.time = time.time()
            stats = self._step_spec_stats
            if stats is not None:
                record.num_drafts = stats.num_drafts
                record.drafted_per_pos = list(stats.num_draft_tokens_per_pos)
                record.accepted_per_pos = list(stats.num_accepted_tokens_per_pos)
            if self._shadow is not None:
                shadow = self._shadow.take()
                record.shadow_source = SHADOW_SOURCE
                record.shadow_seqs = shadow.seqs
                record.shadow_drafted_per_pos = shadow.drafted_per_pos
                record.shadow_accepted_per_pos = shadow.accepted_per_pos
            if self._pending:
                self._take_rejected_from_next(scheduler_output, model_runner_output)
            # Everything this class added since the last record (this update's share read
            # here; what is left of it counts in the next record).
            record.overhead_s = self._overhead_s + self._clock() - hook_start
            self._overhead_s = 0.0
            self._slot.record_step(record)
        else:
            self._overhead_s += self._clock() - hook_start
        self._last_update_end = now
        return outputs

    def _take_rejected_from_next(self, scheduler_output, model_runner_output) -> None:
        """Async scheduling: the step scheduled after this one counted this step's drafts in its
        requests' context before knowing which were accepted; the worker drops the rejected
        ones, so the record does too."""
        sampled = model_runner_output.sampled_token_ids  # [request index] -> 1 + accepted tokens
        index = model_runner_output.req_id_to_index
        rejected = {req_id: len(drafts) - max(len(sampled[index[req_id]]) - 1, 0)
                    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
                    if sampled and req_id in index}
        for _, later, later_output in self._pending.values():
            later.context_tokens -= sum(n for req_id, n in rejected.items()
                                        if req_id in later_output.num_scheduled_tokens)


class AdaspecSyncScheduler(AdaspecMixin, Scheduler):
    """For `scheduler_config.async_scheduling` off (vLLM's CPU build; pooling models)."""

    ASYNC = False


class AdaspecAsyncScheduler(AdaspecMixin, AsyncScheduler):
    """For `scheduler_config.async_scheduling` on (vLLM's default on CUDA for most drafters)."""

    ASYNC = True


class AdaspecScheduler:
    """The `scheduler_cls` the app passes to vLLM: constructing it returns the variant that
    matches the resolved `scheduler_config.async_scheduling` (EngineCore constructs the
    scheduler with keyword arguments, `vllm_config=` among them, after resolving it)."""

    def __new__(cls, *args, vllm_config, **kwargs):
        variant = AdaspecAsyncScheduler if vllm_config.scheduler_config.async_scheduling else AdaspecSyncScheduler
        # Not an instance of cls, so Python does not call __init__ a second time.
        return variant(*args, vllm_config=vllm_config, **kwargs)
