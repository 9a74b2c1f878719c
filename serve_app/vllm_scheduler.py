"""A vLLM scheduler that takes live speculation policies and records every step.

It runs inside vLLM's engine-core process (passed as `scheduler_cls`). vLLM 0.32 decides the
speculation length of a step from `Scheduler.dynamic_sd_lookup`, a dense list
batch size -> k built once from `num_speculative_tokens_per_batch_size`. We replace that
list when a policy arrives, so a policy costs nothing per step.

The channel: EngineCore dispatches a utility call by attribute name,
`getattr(engine_core, name)(*args)`, between two steps, in the engine loop's own thread.
The engine core's attribute `scheduler` is this object, so a utility call named
"scheduler" lands in `__call__` below. A policy applied by a call that has returned is
therefore in force from the next scheduled step on, with no lock and no polling.

Step timing: a step runs schedule() -> model forward (draft + verify) -> update_from_output();
its duration is measured from the start of schedule() to the end of update_from_output().
"""

from __future__ import annotations

import time

from adaspec.engine_contract import PolicySlot
from adaspec.policy import OPEN_END, PolicyRule, SpecConfig, SpecPolicy
from adaspec.telemetry import EngineCapabilities, RequestLifetimes, StepRecord
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus


def _policy_from_vllm_table(table: list, version: int = 0) -> SpecPolicy:
    """The SpecPolicy equivalent of vLLM's [[lo, hi, k], ...] start-up table."""
    rules = []
    for i, (lo, hi, k) in enumerate(table):
        last = i == len(table) - 1
        rules.append(PolicyRule(batch_lo=lo, batch_hi=OPEN_END if last else hi, config=SpecConfig.chain(k)))
    return SpecPolicy(version=version, rules=tuple(rules))


class AdaspecScheduler(Scheduler):
    """vLLM's scheduler, plus a live policy and a per-step telemetry buffer (a PolicySlot)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        spec = self.vllm_config.speculative_config
        if spec is None or self.dynamic_sd_lookup is None:
            raise RuntimeError(
                "AdaspecScheduler needs speculative_config.num_speculative_tokens_per_batch_size"
            )
        # vLLM speculates in chains only, up to the k it was started with.
        capabilities = EngineCapabilities(engine="vllm", max_batch_size=self.scheduler_config.max_num_seqs,
                                          max_k=self.num_spec_tokens, supports_trees=False,
                                          draft_method=spec.method)
        self._slot = PolicySlot(capabilities, _policy_from_vllm_table(spec.num_speculative_tokens_per_batch_size))
        self._pending: dict[int, tuple[float, StepRecord]] = {}  # id(scheduler_output) -> start
        self._step_spec_stats = None
        self._prev_k = 0  # k decided by the previous step: what this step verifies
        self._lifetimes = RequestLifetimes()

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
            running, waiting = self.get_request_counts()
            return self._slot.drain(waiting=waiting, running=running).model_dump_json()
        if command == "capabilities":
            return self._slot.capabilities.model_dump_json()
        raise ValueError(f"unknown adaspec scheduler command {command!r}")

    # ------------------------------------------------------------------ step recording
    def schedule(self, *args, **kwargs):
        start = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        num_scheduled = output.num_scheduled_tokens  # req_id -> tokens this step
        batch = len(num_scheduled)
        if batch == 0:
            return output
        spec_tokens = output.scheduled_spec_decode_tokens  # req_id -> draft token ids
        decode = prefill = context = 0
        for req_id, n_tokens in num_scheduled.items():
            request = self.requests[req_id]
            # schedule() has already advanced num_computed_tokens by this step's tokens.
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
        self._pending[id(output)] = (start, record)
        self._lifetimes.step(num_scheduled, batch, record.config)
        return output

    def _free_request(self, request, *args, **kwargs):
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._lifetimes.discard(request.request_id)
        else:
            record = self._lifetimes.finish(request.request_id, request.arrival_time,
                                            request.num_prompt_tokens, request.num_output_tokens)
            if record is not None:
                self._slot.record_request(record)
        return super()._free_request(request, *args, **kwargs)

    def make_stats(self, spec_decoding_stats=None, *args, **kwargs):
        # Called once per update_from_output with this step's SpecDecodingStats.
        self._step_spec_stats = spec_decoding_stats
        return super().make_stats(spec_decoding_stats, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        self._step_spec_stats = None
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is not None:
            start, record = pending
            now = time.perf_counter()
            record.duration_s = now - start
            record.time = time.time()
            stats = self._step_spec_stats
            if stats is not None:
                record.num_drafts = stats.num_drafts
                record.drafted_per_pos = list(stats.num_draft_tokens_per_pos)
                record.accepted_per_pos = list(stats.num_accepted_tokens_per_pos)
            self._slot.record_step(record)
        return outputs
