"""What goes into and out of the engine per request, and when a request is finished.

Types a serving wrapper sees: `SamplingParams` (in), `RequestOutput` (out, one per request
per step that changed it). `Request` is the engine's own per-request state.

Finish reasons (OpenAI's): "stop" (EOS, a stop token id or a stop string), "length"
(max_tokens), "abort" (cancelled). Token ids include the EOS / stop token that ended the
request; `text` excludes a matched stop string, as OpenAI's API does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # output tokens, at most
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept when sampling
    stop: tuple[str, ...] = ()  # stop strings (need the engine's tokenizer)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # a per-request generator, for reproducible sampling

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    """A request's progress in one step."""

    request_id: str
    new_token_ids: list[int]  # tokens produced in this step (after truncation at a stop)
    finished: bool
    finish_reason: str | None = None  # stop | length | abort
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far
    text: str | None = None  # the whole output text so far (with a tokenizer), stop string cut


@dataclass(eq=False)  # identity: requests are compared as objects, not by value
class Request:
    """Engine-side state of one request."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float  # unix seconds
    output: list[int] = field(default_factory=list)
    row: int = -1  # KV-cache row while running
    cache_len: int = 0  # tokens of prompt + output held in the target's KV cache
    finish_reason: str | None = None
    text: str | None = None
    generator: torch.Generator | None = None
    # Per-request budgets (native_engine.budget): decayed draft tokens accepted, and the
    # calibrated estimate of how many its verified candidates would be.
    draft_accepted: float = 0.0
    draft_expected: float = 0.0
    last_verify: int = 0  # what its previous budgeted step did (native_engine.budget.LAST_*)
    offers: list = field(default_factory=list)  # native_engine.budget.Offer not yet resolved in hindsight

    @property
    def context(self) -> list[int]:
        """Committed tokens: the prompt and the output so far (the last one is the root)."""
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int], eos_ids: frozenset[int], decode=None) -> list[int]:
        """Append gained tokens up to the first finish condition; return those appended.

        decode: token ids -> text (the tokenizer's), needed for stop strings and `text`."""
        p = self.params
        taken: list[int] = []
        cut_text = None
        for tok in tokens:
            self.output.append(tok)
            taken.append(tok)
            if (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish_reason = "stop"
            elif p.stop and decode is not None and (cut_text := self._stop_string_cut(decode)) is not None:
                self.finish_reason = "stop"
            elif len(self.output) >= p.max_tokens:
                self.finish_reason = "length"
            if self.finished:
                break
        if decode is not None:
            self.text = cut_text if cut_text is not None else decode(self.output)
        return taken

    def _stop_string_cut(self, decode) -> str | None:
        """The output text before the first stop string, or None if none occurs yet."""
        text = decode(self.output)
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        return text[: min(hits)] if hits else None
