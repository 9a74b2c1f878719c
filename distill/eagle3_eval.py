"""How good an EAGLE-3 head is for its target: acceptance per position, accepted length, cost.

Measured on held-out prompts the target continues itself (greedy, and sampled at T=0.7), as
vLLM drafts with a head: each draft token is the head's argmax (vLLM's default
`draft_sample_method`), so
- T=0: the i-th token of a chain is accepted when it equals the target's greedy token: exact,
  since a chain's inputs after accepted tokens are the target's own tokens;
- T=0.7: it is accepted with probability p(x) under the target's T=0.7 distribution
  (rejection sampling with a one-hot draft), p from the target's top-32 log-probabilities.
Unlike a draft model, a head's i-th proposal depends on where its chain started (the first
reads the target's features, later ones its own outputs), so each chain position is read from
its own unrolled step and `replay_chains` replays decoding over them.

Cost: one draft step at batch 1 (fc, the layer over one token, the draft-vocabulary head)
against one target decode forward (native engine, KV cache of ~256 tokens), interleaved.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch

from distill.eagle3_data import FeatureSequence
from distill.evaluate import format_rate, replay_chains
from native_engine.eagle3 import Eagle3Head
from native_engine.kv_cache import KVCache
from native_engine.model import Transformer

EVAL_STEPS = 6  # chain positions reported


@dataclass
class HeadEval:
    dataset: str
    prompts: int
    generated_tokens: int
    acceptance_t0: list[float | None]  # [position 1..EVAL_STEPS], conditional; None: never reached
    acceptance_t07: list[float | None]
    accepted_length_t0: dict[int, float]  # k -> tokens per verify step, bonus included
    accepted_length_t07: dict[int, float]
    head_ms: float
    target_ms: float

    @property
    def cost_ratio(self) -> float:
        return self.head_ms / self.target_ms

    def table(self) -> str:
        S = len(self.acceptance_t0)
        return "\n".join([
            f"{self.dataset}: {self.prompts} held-out prompts, {self.generated_tokens} target tokens (T=0)",
            "position              " + " ".join(f"{i:>5d}" for i in range(1, S + 1)),
            "acceptance T=0        " + " ".join(format_rate(v, 5) for v in self.acceptance_t0),
            "acceptance T=0.7      " + " ".join(format_rate(v, 5) for v in self.acceptance_t07),
            "k                     " + " ".join(f"{k:>5d}" for k in self.accepted_length_t0),
            "accepted length T=0   " + " ".join(f"{v:5.2f}" for v in self.accepted_length_t0.values()),
            "accepted length T=0.7 " + " ".join(f"{v:5.2f}" for v in self.accepted_length_t07.values()),
            f"cost per drafted token: head {self.head_ms:.2f} ms, target {self.target_ms:.2f} ms, "
            f"ratio {self.cost_ratio:.3f}"])


@torch.no_grad()
def chain_acceptance(head: Eagle3Head, embed: torch.nn.Embedding, seq: FeatureSequence, steps: int,
                     temperature: float) -> torch.Tensor | None:
    """[steps, n] acceptance of the i-th token of a chain starting at each generated position
    (t = 0 is the chain drafted right after the prefill's token), along the target's path."""
    L, first = len(seq.tokens), seq.prompt_len - 1  # the slot whose chain follows the prefill's token
    n = L - seq.prompt_len - 1  # generated tokens a chain can propose (the first came from the prefill)
    if n <= 0:
        return None
    tokens = torch.cat([seq.tokens.long(), torch.zeros(steps, dtype=torch.long)])
    outs = head.unrolled(seq.aux.float()[None], embed(tokens[1:L + steps][None]), steps)
    out = torch.zeros((steps, n), dtype=torch.float64)
    for s, h in enumerate(outs):
        pred = head.draft_to_target(head.logits(h[0, first:first + n]).argmax(-1))  # [n]
        at = torch.arange(n) + first + 1 + s  # the position whose next token slot first + t predicts
        ok = at < L - 1
        at = at.clamp(max=L - 2)
        if temperature == 0:
            acc = (pred == seq.tokens[at + 1].long()).double()
        else:
            lps = seq.topk_logprobs[at].float() / temperature
            p = torch.softmax(lps, dim=-1)
            hit = seq.topk_ids[at].long() == pred[:, None]
            acc = (p * hit).sum(-1).double()
        out[s] = torch.where(ok, acc, torch.zeros(()))
    return out


@torch.no_grad()
def step_ms(head: Eagle3Head, target: Transformer, context: int = 256, repeats: int = 20) -> tuple[float, float]:
    """Median ms of one batch-1 draft step (head) and one target decode forward, interleaved."""
    if not target.serving:
        target = copy.deepcopy(target).prepare_for_serving()
    a = target.args
    cache = KVCache.allocate(a.n_layers, 1, a.n_kv_heads, context + repeats + 8, a.head_dim,
                             target.lm_head.weight.dtype)
    aux = torch.randn(1, 1, head.args.fc_in)
    emb = torch.randn(1, 1, head.args.target.dim)
    times = {"head": [], "target": []}
    for r in range(repeats + 3):
        t = time.perf_counter()
        head.logits(head.unrolled(aux, emb, 1)[0][:, -1])
        if r >= 3:
            times["head"].append((time.perf_counter() - t) * 1e3)
        pos = torch.tensor([[context + r]])
        mask = torch.ones((1, 1, 1, context + r + 1), dtype=torch.bool)
        t = time.perf_counter()
        h = target(torch.tensor([[5]]), pos, mask, cache, 0, pos, context + r + 1)
        target.logits(h[:, -1])
        if r >= 3:
            times["target"].append((time.perf_counter() - t) * 1e3)
    return statistics.median(times["head"]), statistics.median(times["target"])


def evaluate(head: Eagle3Head, embed: torch.nn.Embedding, target: Transformer, greedy: list[FeatureSequence],
             sampled: list[FeatureSequence], dataset: str, steps: int = EVAL_STEPS) -> HeadEval:
    head.eval()
    t0 = [c for c in (chain_acceptance(head, embed, s, steps, 0.0) for s in greedy) if c is not None]
    t07 = [c for c in (chain_acceptance(head, embed, s, steps, 0.7) for s in sampled) if c is not None]
    acc0, len0 = replay_chains(t0)
    acc07, len07 = replay_chains(t07)
    head_ms, target_ms = step_ms(head, target)
    generated = sum(len(s.tokens) - s.prompt_len for s in greedy)
    return HeadEval(dataset, len(greedy), generated, acc0, acc07, len0, len07, head_ms, target_ms)
