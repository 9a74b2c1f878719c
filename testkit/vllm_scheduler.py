"""vLLM 0.32's schedulers without a model: a scheduler built from configs alone, requests, and
the two engine loops (sync and async scheduling) driven by a stand-in model runner.

Adapted from vLLM's own scheduler tests (tests/v1/core/utils.py: `create_scheduler`,
`create_requests`), which are not in the wheel. The engine loops follow
vllm/v1/engine/core.py: `step` + `post_step` (sync: drafts are handed to the scheduler after
each step) and `step_with_batch_queue` (async: step N+1 is scheduled before step N's output
is processed, and the drafts stay in the worker). `ScriptedEngine`: a greedy stand-in target
whose tokens are given in advance, drafted for by vLLM's own NgramProposer (sync only).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
NUM_BLOCKS = 1000
MAX_MODEL_LEN = 512
TOKEN = 7  # every sampled token: never EOS, and n-gram-free (the stand-in runner decides acceptance)

# A tiny Llama config: ModelConfig reads only config.json (no weights, no tokenizer).
_TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
               "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "intermediate_size": 128, "max_position_embeddings": 1024, "torch_dtype": "float32"}


def vllm_config(table: list[list[int]], async_scheduling: bool, max_num_seqs: int = 8,
                max_model_len: int = MAX_MODEL_LEN) -> VllmConfig:
    """An ngram speculative config started at the largest k of `table` ([[lo, hi, k], ...])."""
    folder = Path(tempfile.mkdtemp(prefix="adaspec-tiny-llama-"))
    (folder / "config.json").write_text(json.dumps(_TINY_LLAMA))
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_model_len,
                                max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=max(k for _, _, k in table),
                             prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens_per_batch_size=table)
    # No prefix caching: it needs block hashers on the requests and has nothing to do with drafts.
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                        speculative_config=spec)
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    # VllmConfig resolves async scheduling itself and turns it off here twice over: the CPU
    # platform forces it off, and vLLM 0.32 refuses it for (CPU) ngram. On CUDA it is on by
    # default for draft_model / EAGLE / MTP / ngram_gpu; the scheduler sees only the resolved
    # flag, so setting it afterwards gives the scheduler exactly what it gets on a GPU.
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def build(scheduler_cls, config: VllmConfig):
    """Construct `scheduler_cls` the way EngineCore does (keyword arguments)."""
    kv_cache = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                                                      dtype=torch.float32))])
    return scheduler_cls(vllm_config=config, kv_cache_config=kv_cache,
                         structured_output_manager=StructuredOutputManager(config), include_finished_set=False,
                         log_stats=True, block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE)


def requests(n: int, prompt_len: int = 10, max_tokens: int = 40) -> list[Request]:
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    return [Request(request_id=str(i), prompt_token_ids=[i + 1] * prompt_len, sampling_params=params,
                    pooling_params=None) for i in range(n)]


def accept_pattern(req_id: str, step: int) -> int:
    """Draft tokens the stand-in runner accepts: varies by request and step, so per-position
    counts differ from position to position."""
    return (int(req_id) + step) % 4


class Engine:
    """An engine core loop over `scheduler` with a stand-in model runner. `async_order`: vLLM's
    `step_with_batch_queue` with a queue of two (as under async scheduling); else `step` then
    `post_step`. Collects every SchedulerOutput and vLLM's own SpecDecodingStats per update."""

    def __init__(self, scheduler, async_order: bool):
        self.scheduler = scheduler
        self.async_order = async_order
        self.queue: list[SchedulerOutput] = []  # in flight, oldest first
        self.scheduled: list[SchedulerOutput] = []  # every non-empty schedule() result, in order
        self.spec_stats: list = []  # per processed non-empty step: vLLM's SpecDecodingStats (or None)
        self.steps = 0

    def add(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.scheduler.add_request(r)

    def run_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            sampled.append([TOKEN] * (1 + min(accept_pattern(rid, self.steps), len(drafts))))
        self.steps += 1
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        if out.total_num_scheduled_tokens:
            self.scheduled.append(out)
        return out

    def _update(self, out: SchedulerOutput) -> None:
        result = self.scheduler.update_from_output(out, self.run_model(out))
        if out.total_num_scheduled_tokens:
            stats = next(iter(result.values())).scheduler_stats if result else None
            self.spec_stats.append(stats.spec_decoding_stats if stats else None)

    def step(self) -> None:
        if not self.async_order:  # EngineCore.step + post_step
            out = self._schedule()
            self._update(out)
            if out.total_num_scheduled_tokens:
                # The drafter proposes the k this step scheduled, for each request decoding next.
                live = [self.scheduler.requests.get(r) for r in out.num_scheduled_tokens]
                ids = [r.request_id for r in live if r is not None and not r.is_finished() and not r.is_prefill_chunk]
                k = out.num_spec_tokens_to_schedule
                self.scheduler.update_draft_token_ids(DraftTokenIds(ids, [[TOKEN] * k for _ in ids]))
            return
        # EngineCore.step_with_batch_queue: fill the queue first, then process the oldest step.
        if self.scheduler.has_requests():
            self.queue.append(self._schedule())
            if len(self.queue) < 2:
                return
        if self.queue:
            self._update(self.queue.pop(0))

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.queue:
                return
            self.step()
        raise AssertionError("requests did not finish")


def scripted_request(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens, temperature=0.0)
    return Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=params, pooling_params=None)


class ScriptedEngine(Engine):
    """A greedy target whose continuation of each request is given (`scripts`: req_id -> the
    tokens it produces, at least max_tokens of them, one more to reject a draft past the
    end), drafted for by vLLM's NgramProposer at the k each step scheduled, as vLLM's sync
    engine does. A draft token is accepted while it equals the script, as greedy
    verification does; the bonus token is the script's next one. Sync scheduling only:
    under async the drafts stay in the worker."""

    def __init__(self, scheduler, scripts: dict[str, list[int]]):
        super().__init__(scheduler, async_order=False)
        self.scripts = scripts
        self.proposer = NgramProposer(scheduler.vllm_config)

    def add_scripted(self, req_id: str, prompt: list[int], script: list[int], max_tokens: int) -> None:
        self.scripts[req_id] = script
        self.add([scripted_request(req_id, prompt, max_tokens)])

    def run_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            if request.num_computed_tokens < request.num_prompt_tokens:  # a prefill chunk: no token
                sampled.append([])
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            done = request.num_output_tokens
            target = self.scripts[rid][done: done + 1 + len(drafts)]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            sampled.append(target[: accepted + 1])
        self.steps += 1
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def step(self) -> None:
        out = self._schedule()
        self._update(out)
        if not out.total_num_scheduled_tokens:
            return
        live = [self.scheduler.requests.get(r) for r in out.num_scheduled_tokens]
        live = [r for r in live if r is not None and not r.is_finished() and not r.is_prefill_chunk]
        k = out.num_spec_tokens_to_schedule
        drafts = self.propose([list(r.all_token_ids) for r in live], k) if k else [[] for _ in live]
        self.scheduler.update_draft_token_ids(DraftTokenIds([r.request_id for r in live], drafts))

    def propose(self, histories: list[list[int]], k: int) -> list[list[int]]:
        """vLLM's NgramProposer.propose on these histories, as its model runner calls it (at
        most max_num_seqs at a time: its buffers hold that many)."""
        batch = len(self.proposer.valid_ngram_num_drafts)
        if len(histories) > batch:
            return [d for i in range(0, len(histories), batch) for d in self.propose(histories[i: i + batch], k)]
        max_len = self.proposer.max_model_len
        token_ids = np.zeros((len(histories), max_len), dtype=np.int32)
        for i, history in enumerate(histories):
            token_ids[i, : len(history)] = history
        lengths = np.array([len(h) for h in histories], dtype=np.int32)
        return self.proposer.propose(k, [[h[-1]] for h in histories], lengths, token_ids)
