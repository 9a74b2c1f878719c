"""How good a draft is for its target: acceptance per position, accepted length, cost ratio.

Terms (as in vLLM and docs/papers.md): a chain of k draft tokens is verified by one target
pass; the *acceptance at position i* is the probability that draft token i is accepted given
tokens 1..i-1 were; the *mean accepted length* is the tokens one verify step yields, the
target's bonus token included: E(k) = 1 + sum_{i<=k} prod_{j<=i} p_j.

Measured on held-out prompts the target continues itself (`max_new_tokens` each):
- T=0 (greedy): exact. The draft's greedy proposal after an accepted prefix equals its
  teacher-forced argmax along the target's greedy path, so one draft pass over that path
  gives every chain's outcome: position t matches when argmax q(. | x<=t) = x_{t+1}.
  Acceptance per position and E(k) then come from replaying speculative decoding from the
  first generated token (`replay_stats`): per position over the steps decoding takes, as an
  engine's telemetry counts it (vLLM's per-position acceptance, adaspec's StepRecord).
- T=1 (sampling, Leviathan et al. 2023): a draft token is accepted with probability
  alpha_t = sum_x min(p_t(x), q_t(x)). Measured along the target's own T=1 samples, summing
  over the target's top-k tokens only (a lower bound; the top 32 hold nearly all the mass).
  Approximation: after an acceptance the context is the target's sample, not the draft's.
  The same replay, in expectation over the accept/reject outcomes.
- Cost ratio: milliseconds of one decode forward at batch 1 (KV cache, ~256 tokens of
  context) for the draft over the target, same code (native_engine.model), same dtype,
  interleaved so load on the machine hits both alike.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from distill.teacher import TeacherSequence, TeacherSettings, generate_batch
from native_engine.kv_cache import KVCache
from native_engine.attention import causal_mask
from native_engine.model import Transformer

MAX_POSITION = 8  # acceptance reported for positions 1..8, E(k) for k = 1..8


@dataclass
class DraftEval:
    dataset: str
    prompts: int
    generated_tokens_t0: int
    acceptance_t0: list[float | None]  # [position 1..8] conditional acceptance; None: never reached
    acceptance_t1: list[float | None]
    mean_accepted_length_t0: dict[int, float]  # k -> tokens per verify step (bonus included)
    mean_accepted_length_t1: dict[int, float]
    draft_ms: float  # one batch-1 decode forward
    target_ms: float
    cost_ratio: float = field(init=False)

    def __post_init__(self):
        self.cost_ratio = self.draft_ms / self.target_ms

    def table(self) -> str:
        lines = [f"{self.dataset}: {self.prompts} held-out prompts, {self.generated_tokens_t0} target tokens (T=0)",
                 "position            " + " ".join(f"{i:>5d}" for i in range(1, MAX_POSITION + 1)),
                 "acceptance T=0      " + " ".join(format_rate(v, 5) for v in self.acceptance_t0),
                 "acceptance T=1      " + " ".join(format_rate(v, 5) for v in self.acceptance_t1),
                 "k                   " + " ".join(f"{k:>5d}" for k in self.mean_accepted_length_t0),
                 "accepted length T=0 " + " ".join(f"{v:5.2f}" for v in self.mean_accepted_length_t0.values()),
                 "accepted length T=1 " + " ".join(f"{v:5.2f}" for v in self.mean_accepted_length_t1.values()),
                 f"cost per token: draft {self.draft_ms:.2f} ms, target {self.target_ms:.2f} ms, "
                 f"ratio {self.cost_ratio:.3f}"]
        return "\n".join(lines)


@torch.no_grad()
def _draft_logprobs(draft: Transformer, seq: TeacherSequence) -> torch.Tensor:
    """Draft log-probs [L - 1, V] along the sequence (teacher forcing, one pass)."""
    toks = seq.tokens.long()[None, :-1]
    T = toks.shape[1]
    h = draft(toks, torch.arange(T)[None], causal_mask(torch.tensor([T]), T))[0]
    return torch.log_softmax(draft.logits(h), dim=-1)


def format_rate(value: float | None, width: int = 0) -> str:
    """An acceptance rate with 3 decimals, or "-" for a position no chain reached."""
    return f"{value:{width}.3f}" if value is not None else "-".rjust(width)


def replay_stats(accept_probs: list[torch.Tensor]) -> tuple[list[float | None], dict[int, float]]:
    """Speculative decoding replayed along each path, in expectation (exact for greedy), for a
    draft whose proposal for a position does not depend on where its chain started (a draft
    model read teacher-forced): accept_probs[s][t] is the probability that a draft token
    proposed for generated position t is accepted (greedy: a bool tensor, True on a match).
    `replay_chains` with chain position i of a chain starting at t reading a[t + i]."""
    chains = []
    for a in accept_probs:
        a = a.double()
        n = a.shape[0]
        padded = torch.cat([a, torch.zeros(MAX_POSITION, dtype=torch.float64)])
        chains.append(torch.stack([padded[i:i + n] for i in range(MAX_POSITION)]))
    return replay_chains(chains)


def replay_chains(chains: list[torch.Tensor]) -> tuple[list[float | None], dict[int, float]]:
    """Speculative decoding replayed along each path, in expectation (exact for greedy).

    chains[p][i, t]: probability that the i-th draft token of a chain that starts at generated
    position t is accepted given the ones before it were ([S, n]; entries with t + i >= n are
    never read). A step starts at t, verifies up to k draft tokens, gains the accepted run plus
    the target's bonus token, and the next step starts after them. Returns the conditional
    acceptance per position 1..S over the steps of k = S (None where no step reached a
    position), and E(k) = tokens / steps for k = 1..S. Steps start where a chain just ended,
    often at a hard token, so these rates are lower than matches counted from every position."""
    paths = [c.double().tolist() for c in chains]
    S = max((len(c) for c in paths), default=MAX_POSITION)
    reach, accept = [0.0] * S, [0.0] * S
    lengths = {}
    for k in range(1, S + 1):
        tokens = steps = 0.0
        for a in paths:
            n = len(a[0]) if a else 0
            start = [0.0] * (n + k + 2)  # [t] probability that a step starts at t
            start[0] = 1.0
            for t in range(n):
                w = start[t]
                if w == 0.0:
                    continue
                steps += w
                prod = 1.0  # P(draft tokens t .. t+i-1 all accepted)
                for i in range(min(k, n - t)):
                    if k == S:
                        reach[i] += w * prod
                    rejected = prod * (1.0 - a[i][t])
                    tokens += w * rejected * (i + 1)
                    start[t + i + 1] += w * rejected
                    prod *= a[i][t]
                    if k == S:
                        accept[i] += w * prod
                run = min(k, n - t)  # every verified token accepted
                tokens += w * prod * (run + 1)
                start[t + run + 1] += w * prod
        lengths[k] = tokens / steps if steps else 1.0
    rates = [acc / r if r > 0 else None for r, acc in zip(reach, accept)]
    return rates, lengths


@torch.no_grad()
def step_ms(target: Transformer, draft: Transformer, context: int = 256, repeats: int = 20) -> tuple[float, float]:
    """Median ms of one batch-1 decode forward (logits included) for draft and target, each as the
    engine serves it (Transformer.prepare_for_serving; a copy when the model is still training)."""
    def make(model):
        if not model.serving:
            model = copy.deepcopy(model).prepare_for_serving()
        a = model.args
        cache = KVCache.allocate(a.n_layers, 1, a.n_kv_heads, context + repeats + 8, a.head_dim,
                                 model.lm_head.weight.dtype)
        return model, cache

    runs = {"draft": make(draft), "target": make(target)}
    times: dict[str, list[float]] = {"draft": [], "target": []}
    for r in range(repeats + 3):  # interleaved, first 3 rounds are warm-up
        for name, (model, cache) in runs.items():
            pos = torch.tensor([[context + r]])
            mask = torch.ones((1, 1, 1, context + r + 1), dtype=torch.bool)
            t = time.perf_counter()
            h = model(torch.tensor([[5]]), pos, mask, cache, 0, pos, context + r + 1)
            model.logits(h[:, -1])
            if r >= 3:
                times[name].append((time.perf_counter() - t) * 1e3)
    return statistics.median(times["draft"]), statistics.median(times["target"])


def heldout_sequences(target: Transformer, prompts: list[list[int]], eos_ids: frozenset[int],
                      max_new_tokens: int, cache: Path | None = None) -> tuple[list, list]:
    """The target's greedy and T=1 continuations of `prompts` (cached in `cache` when given)."""
    if cache is not None and cache.is_file():
        data = torch.load(cache, weights_only=True)
        return ([TeacherSequence(**d) for d in data["t0"]], [TeacherSequence(**d) for d in data["t1"]])
    settings = TeacherSettings(max_new_tokens=max_new_tokens)
    gen = torch.Generator().manual_seed(1234)
    t0 = generate_batch(target, prompts, settings, 0.0, eos_ids, gen)
    t1 = generate_batch(target, prompts, settings, 1.0, eos_ids, gen)
    if cache is not None:
        from dataclasses import asdict

        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save({"t0": [asdict(s) for s in t0], "t1": [asdict(s) for s in t1]}, tmp)
        tmp.replace(cache)
    return t0, t1


@torch.no_grad()
def evaluate(target: Transformer, draft: Transformer, t0: list[TeacherSequence], t1: list[TeacherSequence],
             dataset: str, measure_cost: bool = True) -> DraftEval:
    """Acceptance and accepted length on held-out continuations; cost ratio on this machine."""
    draft.eval()
    matches, alphas, generated = [], [], 0
    for seq in t0:
        start = seq.prompt_len - 1  # the position that predicts the first generated token
        if len(seq.tokens) - 1 <= start:
            continue
        pred = _draft_logprobs(draft, seq)[start:].argmax(-1)
        matches.append(pred == seq.tokens[start + 1:].long())
        generated += len(seq.tokens) - seq.prompt_len
    for seq in t1:
        start = seq.prompt_len - 1
        if len(seq.tokens) - 1 <= start:
            continue
        q = _draft_logprobs(draft, seq)[start:].exp()  # [n, V]
        ids = seq.topk_ids[start:].long()
        p = seq.topk_logprobs[start:].float().exp()
        alphas.append(torch.minimum(p, q.gather(1, ids)).sum(-1))
    acc0, len0 = replay_stats(matches)
    acc1, len1 = replay_stats(alphas)
    draft_ms, target_ms = step_ms(target, draft) if measure_cost else (float("nan"), 1.0)
    return DraftEval(dataset, len(t0), generated, acc0, acc1, len0, len1, draft_ms, target_ms)
