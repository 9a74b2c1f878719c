"""An open-loop load generator for OpenAI-compatible servers (adaspec, or a plain vLLM server).

Requests arrive at gamma-distributed intervals with mean 1/rate and shape `burstiness`
(1 = a Poisson process, <1 burstier, >1 more regular; vLLM's `bench serve` draws them the
same way); rate inf sends every request at once. Each request streams, so the client sees
when the first token and every later chunk arrive. Chat prompts (ShareGPT) go through
/v1/chat/completions, code prefixes (HumanEval) through /v1/completions, with the official
`openai` client.

`realistic_mix` gives requests as served traffic has them: a share greedy, the rest at
temperature 0.7 / top_p 0.9, all stopping at EOS (`adaspec bench` and `adaspec sweep` use it
unless told otherwise, see `samplings`). SYNTHETIC requests are greedy and ask for exactly
`max_tokens` tokens with `ignore_eos`, as the field's benchmarks do (vLLM's client for
ShareGPT's output lengths): every policy then does the same work. The cost: text past the
natural end drifts into repetition, which n-gram drafting predicts far better than real
continuations, so synthetic runs overstate what speculation buys (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import openai
from pydantic import BaseModel, Field
from tqdm import tqdm

from adaspec.datasets import Prompt


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds; `sent_at` from the run's start."""

    prompt_id: str
    dataset: str
    sent_at: float
    e2e_s: float  # send -> last byte
    ttft_s: float | None  # send -> first content chunk (None: no token came back)
    itl_s: list[float] = field(default_factory=list)  # gaps between later content chunks
    output_tokens: int = 0  # the server's usage count
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class Sampling:
    """How one request decodes."""

    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = True  # run to max_tokens whatever the model says (a synthetic regime)


SYNTHETIC = Sampling()  # greedy, ignore_eos: what the benchmarks before realistic_mix sent
SAMPLED = Sampling(temperature=0.7, top_p=0.9, ignore_eos=False)
GREEDY_TO_EOS = Sampling(ignore_eos=False)


def realistic_mix(n: int, seed: int, greedy_share: float = 0.5) -> list[Sampling]:
    """The sampling of n requests: round(greedy_share * n) greedy, the rest at T=0.7 and
    top_p 0.9, every one stopping at EOS; in an order drawn from `seed`."""
    greedy = round(greedy_share * n)
    mix = [GREEDY_TO_EOS] * greedy + [SAMPLED] * (n - greedy)
    random.Random(seed).shuffle(mix)
    return mix


def arrival_times(rate: float, n: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """Offsets (seconds) of n arrivals: gamma inter-arrival times with mean 1/rate and shape
    `burstiness` (1 = Poisson); rate inf sends everything at once."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def arrivals_until(rate: float, duration_s: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Offsets (seconds) of the arrivals of the same process that fall before `duration_s`."""
    if rate == float("inf"):
        raise ValueError("a timed segment needs a finite rate")
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        if t >= duration_s:
            return out
        out.append(t)


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: Prompt, max_tokens: int, sampling: Sampling):
    common = dict(model=model, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                  stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": sampling.ignore_eos})
    if prompt.chat:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": prompt.text}], **common)
    else:
        stream = await client.completions.create(prompt=prompt.text, **common)
    async for chunk in stream:
        text = ""
        if chunk.choices:
            choice = chunk.choices[0]
            text = (choice.delta.content or "") if prompt.chat else (choice.text or "")
        yield text, chunk.usage


async def send_one(client: openai.AsyncOpenAI, model: str, prompt: Prompt, max_tokens: int,
                   start: float, offset: float, sampling: Sampling = SYNTHETIC) -> RequestResult:
    """Wait until `start + offset` (perf_counter seconds), send, and time the stream."""
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    sent = time.perf_counter()
    result = RequestResult(prompt.id, prompt.dataset, sent - start, 0.0, None)
    last = sent
    try:
        async for text, usage in _stream(client, model, prompt, max_tokens, sampling):
            now = time.perf_counter()
            if text:
                if result.ttft_s is None:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
            if usage is not None:
                result.output_tokens = usage.completion_tokens
                result.prompt_tokens = usage.prompt_tokens
    except openai.OpenAIError as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
    result.e2e_s = time.perf_counter() - sent
    if not result.error and result.output_tokens == 0:
        result.error = "no usage in the stream"
    return result


class RequestMix(BaseModel):
    """How a benchmark's requests decode and stop (its --temperature, --top-p, --greedy-share
    and --ignore-eos flags)."""

    temperature: float | None = Field(default=None, ge=0, description="every request at this temperature; "
                                                                      "None: the realistic mix")
    top_p: float = Field(default=0.9, gt=0, le=1, description="nucleus sampling above temperature 0")
    greedy_share: float = Field(default=0.5, ge=0, le=1, description="greedy share of the realistic mix")
    ignore_eos: bool = Field(default=False, description="synthetic: every request runs to max_tokens")

    @classmethod
    def synthetic(cls) -> RequestMix:
        return cls(temperature=0.0, ignore_eos=True)

    def samplings(self, n: int, seed: int) -> list[Sampling]:
        """How each of n requests decodes: the realistic mix (`greedy_share` greedy, the rest
        T=0.7 / top_p 0.9, all stopping at EOS) when no temperature is set, else every one at
        `temperature` (greedy at 0)."""
        if self.temperature is None:
            mix = realistic_mix(n, seed, self.greedy_share)
            return [Sampling(s.temperature, s.top_p, self.ignore_eos) for s in mix]
        return [Sampling(self.temperature, self.top_p if self.temperature > 0 else 1.0, self.ignore_eos)] * n

    def describe(self, max_tokens: int) -> str:
        """One line for reports."""
        if self.temperature is None:
            how = f"realistic mix: {self.greedy_share:.0%} greedy, the rest T=0.7 top_p 0.9"
        else:
            how = "greedy" if self.temperature == 0 else f"T={self.temperature:g} top_p {self.top_p:g}"
        if self.ignore_eos:
            return f"{how}; SYNTHETIC: ignore_eos, exactly {max_tokens} tokens each"
        return f"{how}; stopping at EOS or at the dataset's reply length, at most {max_tokens} tokens"


async def run_load(base_url: str, model: str, prompts: list[Prompt], offsets: list[float], max_tokens: int | list[int],
                   progress: bool = True, timeout_s: float = 1800,
                   sampling: list[Sampling] | None = None) -> list[RequestResult]:
    """Send prompts[i] at offsets[i] seconds from now, asking for at most max_tokens (or
    max_tokens[i]) tokens, decoding as sampling[i] says (default: SYNTHETIC for every one);
    return the results in prompt order."""
    sampling = sampling or [SYNTHETIC] * len(prompts)
    caps = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused",
                                max_retries=0, timeout=timeout_s)
    bar = tqdm(total=len(prompts), disable=not progress, unit="req", leave=False)
    start = time.perf_counter()

    async def tracked(prompt: Prompt, offset: float, how: Sampling, cap: int) -> RequestResult:
        r = await send_one(client, model, prompt, cap, start, offset, how)
        bar.update(1)
        return r

    try:
        return list(await asyncio.gather(*(tracked(p, o, h, c) for p, o, h, c in zip(prompts, offsets, sampling, caps))))
    finally:
        bar.close()
        await client.close()
