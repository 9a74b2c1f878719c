"""An open-loop load generator for OpenAI-compatible servers (adaspec, or a plain vLLM server).

Requests arrive at gamma-distributed intervals with mean 1/rate and shape `burstiness`
(1 = a Poisson process, <1 burstier, >1 more regular; vLLM's `bench serve` draws them the
same way); rate inf sends every request at once. Each request streams, so the client sees
when the first token and every later chunk arrive. Chat prompts (ShareGPT) go through
/v1/chat/completions, code prefixes (HumanEval) through /v1/completions, with the official
`openai` client.

By default every request is greedy (temperature 0) and asks for exactly `max_tokens` tokens
with `ignore_eos`, as the field benchmarks (vLLM's client does the same for ShareGPT's output
lengths): every policy then does the same work, and a per-token latency compares like with
like. The cost: text past the natural end drifts into repetition, which n-gram drafting
predicts better than real continuations (acceptance somewhat optimistic), and with sampling
speculation pays far less (README). `realistic_mix` gives requests as served traffic has them
instead: a share greedy, the rest at temperature 0.7 / top_p 0.9, all stopping at EOS.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import openai
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


SYNTHETIC = Sampling()  # greedy, ignore_eos: the default of every benchmark here so far
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


async def run_load(base_url: str, model: str, prompts: list[Prompt], offsets: list[float], max_tokens: int,
                   progress: bool = True, timeout_s: float = 1800,
                   sampling: list[Sampling] | None = None) -> list[RequestResult]:
    """Send prompts[i] at offsets[i] seconds from now, decoding as sampling[i] says (default:
    SYNTHETIC for every one); return the results in prompt order."""
    sampling = sampling or [SYNTHETIC] * len(prompts)
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused",
                                max_retries=0, timeout=timeout_s)
    bar = tqdm(total=len(prompts), disable=not progress, unit="req", leave=False)
    start = time.perf_counter()

    async def tracked(prompt: Prompt, offset: float, how: Sampling) -> RequestResult:
        r = await send_one(client, model, prompt, max_tokens, start, offset, how)
        bar.update(1)
        return r

    try:
        return list(await asyncio.gather(*(tracked(p, o, h) for p, o, h in zip(prompts, offsets, sampling))))
    finally:
        bar.close()
        await client.close()
