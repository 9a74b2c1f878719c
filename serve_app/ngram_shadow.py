"""Shadow acceptance for prompt lookup (vLLM `method: ngram`): at every engine step, what the
n-gram drafter WOULD have drafted for each decoding request, for every k in 1..max_k, scored
against the tokens the target then produced. It runs whatever k is in force, `off` (k = 0)
included, so the controller knows the acceptance of every chain while it runs none of them
(issue 51, item 1).

How a shadow draft is made. vLLM's n-gram drafter (vllm/v1/spec_decode/ngram_proposer.py)
finds the longest suffix n-gram of the history (prompt_lookup_min..max tokens) that occurred
earlier, and proposes the tokens that followed it. The match does not depend on k: k only
cuts the proposal (`origin_tokens[start : start + k]`, k first clipped to max_model_len). So
the proposal for k is the first k tokens of the proposal for max_k, and ONE call per
sequence per step, with k = max_k, gives every chain's draft. The call is vLLM's own
per-sequence helper, `_find_longest_matched_ngram_and_propose_tokens` (the numba function its
`batch_propose_numba` runs for each request), with the engine's prompt_lookup_min/max and
max_model_len: no copy of the matching here. `tests/test_ngram_shadow.py` fails if it ever
disagrees with `NgramProposer.propose` on the same history.

How it is scored. A draft made from the history before step N (that is, after step N-1's
output: where vLLM drafts too) is compared with the tokens that follow that history, as they
arrive: position i is accepted when draft tokens 0..i all equal the produced tokens. A draft
is settled at its first mismatch, or when all its tokens are matched; so it waits at most
max_k tokens, and a sequence holds at most max_k unsettled drafts. Its counts go into the
record of the step whose output settled it (up to max_k steps after the draft was made).
When a request finishes, its unsettled drafts are settled with the tokens it produced: a
draft position past the last token counts as drafted and rejected (it would have gained
nothing). An aborted request's unsettled drafts are dropped.

What the counts mean:
- Greedy requests: exact. The target's next tokens do not depend on k, so "the draft equals
  the produced tokens" is what verification would have accepted. Under the k in force the
  shadow counts at positions < k are vLLM's own measured counts (tested).
- Sampled requests: an estimate. vLLM's rejection sampler accepts an n-gram draft token x
  (a draft with no probabilities, i.e. probability 1) with probability p_target(x), and the
  sampled token equals x with the same probability, so each position is unbiased given the
  history; but the history itself is one sample, and the steps at which drafts are made are
  those of the policy in force (every token under `off`, after each verification under
  chainK), not those chainK would have run.

Cost: one numba call per decoding sequence per step, linear in its history (vLLM's drafter
pays the same when it drafts), plus a few list compares. A step scans at most
`max_scan_tokens` history tokens; beyond that, sequences skip drafting in that step, in a
rotating order so none is always skipped (fewer samples, same estimate).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

SHADOW_SOURCE = "ngram-replay"  # StepRecord.shadow_source of these counts
DEFAULT_MAX_SCAN_TOKENS = 1 << 17  # history tokens scanned per step: about 0.3 ms (2 us per 1k tokens)


def ngram_draft(history: np.ndarray, min_n: int, max_n: int, max_model_len: int, k: int) -> np.ndarray:
    """vLLM's n-gram proposal for one sequence's history (int32, contiguous): up to k tokens."""
    return _find_longest_matched_ngram_and_propose_tokens(history, min_n, max_n, max_model_len, k)


@dataclass(slots=True)
class ShadowCounts:
    """Shadow drafts settled since the last take, in StepRecord's per-position terms."""

    seqs: int = 0  # drafts settled: sequences the drafter was asked for, drafted or not
    drafted_per_pos: list[int] = field(default_factory=list)  # [position] -> drafts that had it
    accepted_per_pos: list[int] = field(default_factory=list)  # [position] -> drafts with 0..position accepted

    def add(self, drafted: int, accepted: int) -> None:
        self.seqs += 1
        for i in range(drafted):
            self.drafted_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


@dataclass(slots=True)
class _Draft:
    start: int  # history length when it was made: draft[i] is checked against tokens[start + i]
    tokens: list[int]


@dataclass(slots=True)
class _Sequence:
    tokens: np.ndarray  # the request's history (prompt + output), int32, grown by doubling
    length: int  # tokens held
    drafts: deque[_Draft] = field(default_factory=deque)  # unsettled, oldest first

    def extend(self, new: Sequence[int]) -> None:
        end = self.length + len(new)
        if end > len(self.tokens):
            grown = np.empty(max(end, 2 * len(self.tokens)), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length:end] = new
        self.length = end


class NgramShadow:
    """Shadow n-gram drafts of the running requests and their settled counts."""

    def __init__(self, max_k: int, min_n: int, max_n: int, max_model_len: int,
                 max_scan_tokens: int = DEFAULT_MAX_SCAN_TOKENS):
        self.max_k, self.min_n, self.max_n, self.max_model_len = max_k, min_n, max_n, max_model_len
        self.max_scan_tokens = max_scan_tokens
        self._seqs: dict[str, _Sequence] = {}
        self._counts = self._empty()
        self._turn = 0  # rotates the order in which a step's sequences may draft
        # numba compiles the helper at its first call (about 0.5 s): at engine start, not in a step.
        ngram_draft(np.zeros(max(min_n, 1) + 1, dtype=np.int32), min_n, max_n, max_model_len, max_k)

    @classmethod
    def for_vllm(cls, vllm_config) -> NgramShadow | None:
        """The shadow of an engine whose drafter is vLLM's CPU n-gram proposer; None otherwise
        (ngram_gpu matches on the GPU with its own kernel; other drafters need a model)."""
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "ngram":
            return None
        return cls(max_k=spec.num_speculative_tokens, min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max,
                   max_model_len=vllm_config.model_config.max_model_len)

    def _empty(self) -> ShadowCounts:
        return ShadowCounts(drafted_per_pos=[0] * self.max_k, accepted_per_pos=[0] * self.max_k)

    # ------------------------------------------------------------------ per step
    def observe_step(self, req_ids: Iterable[str], requests: Mapping[str, object]) -> None:
        """After a step's output is in: for each request it ran that is still running, take its
        new tokens, settle the drafts they decide, and draft from the new history (the history
        the next step drafts from). `requests`: req_id -> vLLM Request (all_token_ids)."""
        ids = list(req_ids)
        if not ids:
            return
        first = self._turn % len(ids)
        self._turn += 1
        budget = self.max_scan_tokens
        for req_id in ids[first:] + ids[:first]:
            request = requests.get(req_id)
            if request is not None:
                budget -= self._observe(req_id, request.all_token_ids, request.num_output_tokens, budget > 0)

    def _observe(self, req_id: str, tokens: Sequence[int], num_output_tokens: int, may_draft: bool) -> int:
        """History tokens scanned (0 when it did not draft)."""
        seq = self._seqs.get(req_id)
        total = len(tokens)
        if seq is None or total < seq.length:  # new, or (never seen in vLLM 0.32) a history that shrank
            if not num_output_tokens:  # still in prefill: vLLM drafts once the first token is sampled
                return 0
            seq = self._seqs[req_id] = _Sequence(np.empty(max(2 * total, 64), dtype=np.int32), 0)
            seq.extend(list(tokens))
        elif total == seq.length:  # no token this step (a prefill chunk): vLLM drafts nothing either
            return 0
        else:
            seq.extend(tokens[seq.length:])
        self._settle(seq, finished=False)
        if not may_draft:
            return 0
        draft = ngram_draft(seq.tokens[: seq.length], self.min_n, self.max_n, self.max_model_len, self.max_k)
        if len(draft):
            seq.drafts.append(_Draft(seq.length, draft.tolist()))
        else:
            self._counts.add(0, 0)  # nothing proposed: rejected at the first position, settled now
        return seq.length

    def _settle(self, seq: _Sequence, finished: bool) -> None:
        """Score the drafts the history now decides (all of them when the request finished)."""
        kept: deque[_Draft] = deque()
        for draft in seq.drafts:
            known = min(len(draft.tokens), seq.length - draft.start)
            produced = seq.tokens[draft.start: draft.start + known].tolist()
            accepted = 0
            while accepted < known and draft.tokens[accepted] == produced[accepted]:
                accepted += 1
            if accepted < known or known == len(draft.tokens) or finished:
                self._counts.add(len(draft.tokens), accepted)
            else:
                kept.append(draft)
        seq.drafts = kept

    def finish(self, req_id: str, tokens: Sequence[int] | None) -> None:
        """A request left: settle its drafts with the tokens it produced (`tokens`: its whole
        history at the end), or drop them (`tokens` None: aborted, its future unknown)."""
        seq = self._seqs.pop(req_id, None)
        if seq is None or tokens is None:
            return
        if len(tokens) > seq.length:
            seq.extend(tokens[seq.length:])
        self._settle(seq, finished=True)

    def take(self) -> ShadowCounts:
        """The counts settled since the last take (then zeroed)."""
        counts, self._counts = self._counts, self._empty()
        return counts
