"""Which draft tokens the target accepts: greedy and exact stochastic tree verification.

Glossary (vLLM's rejection sampler; SpecInfer, Miao et al. 2024, Algorithm 2)
- accepted tokens: draft nodes on the path root -> deepest accepted node.
- bonus token: one token sampled from the target at the deepest accepted node; so a verify
  step always gains 1 + accepted tokens (the "accepted length").
- target rows: verify row 0 is the root, row i + 1 is draft node i; `probs[row]` /
  `argmax[row]` is the target's next-token distribution / choice after that row's token.

Greedy (T = 0): walk down from the root; at each node move to the child whose token equals
the target's argmax there, else stop and emit the argmax as the bonus token. Output equals
the target's own greedy decoding token for token.

Stochastic, deterministic candidates (`accept_sampled`; n-gram matches, a draft model's top-w
children): SpecInfer's recursive rejection sampling with each candidate's draft
distribution a point mass. At a node with target distribution p and candidates x_1..x_w:
accept x_i with probability p(x_i) / (mass of p not yet rejected); on rejection zero p(x_i);
if all are rejected, sample the bonus token from p with the rejected candidates zeroed. Each
emitted token is then distributed exactly as p, whatever the candidates were.

Stochastic, sampled candidates (`accept_sampled_from_draft`; children drawn i.i.d. from the
draft distribution q): accept x_i with probability min(1, p(x_i) / q(x_i)); on rejection
p <- norm(max(p - q, 0)); if all are rejected, sample from the residual p. Also exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Acceptance:
    """The outcome of verifying one sequence's draft tree."""

    path: list[int] = field(default_factory=list)  # verify rows kept, root first: [0, r1, r2, ...]
    ranks: list[int] = field(default_factory=list)  # [depth - 1] -> sibling rank of the accepted node
    tokens: list[int] = field(default_factory=list)  # tokens gained: accepted nodes' then the bonus

    def accept(self, rank: int, node: int, token: int) -> int:
        """Record the accepted child `node` (sibling `rank`); returns its verify row."""
        self.ranks.append(rank)
        self.tokens.append(token)
        self.path.append(node + 1)
        return node + 1

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the bonus token excluded)."""
        return len(self.ranks)


# Candidates for the nucleus, tried in turn before a sort of the whole vocabulary. On the
# served mix (T = 0.7, top_p 0.9) most rows' nucleus holds a few tokens, and a top-64 costs a
# quarter of a top-1024 over a 49k vocabulary (0.08 against 0.32 ms per row, 2 threads, Xeon).
NUCLEUS_TOP_K = (64, 1024)


def sample_index(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index of `weights` [V] (non-negative, not all zero) drawn with probability
    weights[i] / weights.sum(): the cumulative sum searched at a uniform draw.

    torch.multinomial draws the same distribution, at 1.3 ms per row of a 49k vocabulary on
    2 CPU threads (an exponential variate per entry) against 0.11 ms here (2026-12-05, AMD
    EPYC), and a sampled decode step draws a token per sampled sequence."""
    cdf = weights.detach().to("cpu", torch.float64).cumsum(0)
    while True:
        u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
        i = int(torch.searchsorted(cdf, u, right=True))
        # u < cdf[-1] but for a draw that rounds up to the total (about 2^-53): drawn again
        if i < len(cdf) and float(weights[i]) > 0:
            return i


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution [..., V] from float logits [..., V]: softmax(logits / T), then
    nucleus filtering (keep the smallest set of most likely tokens with mass >= top_p).

    The nucleus is found among the k likeliest tokens for the first k of NUCLEUS_TOP_K whose
    tokens hold top_p of the mass in every row (every token outside them would be dropped
    anyway), else in a sort of the whole vocabulary: on a 49k vocabulary a full sort costs
    about 2.1 ms per row on 2 CPU threads, a top-1024 0.32 ms, a top-64 0.08 ms, and a sampled
    verify pass has a row per tree node."""
    probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    if top_p < 1.0:
        for k in NUCLEUS_TOP_K:
            if k < probs.shape[-1]:
                sorted_p, order = probs.topk(k, dim=-1)  # sorted, largest first
                if bool((sorted_p.sum(-1) >= top_p).all()):
                    break
        else:
            sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # mass before this token already >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_greedy(children: list[list[int]], tokens: list[int], argmax: list[int]) -> Acceptance:
    """Longest path whose tokens equal the target's argmax; children[row] lists node ids."""
    out = Acceptance(path=[0])
    row = 0
    while True:
        want = argmax[row]
        for rank, node in enumerate(children[row]):
            if tokens[node] == want:
                row = out.accept(rank, node, want)
                break
        else:
            out.tokens.append(want)  # bonus token
            return out


def accept_sampled(children: list[list[int]], tokens: list[int], probs: torch.Tensor,
                   generator: torch.Generator) -> Acceptance:
    """Recursive rejection sampling with point-mass candidates; probs [T, V] target rows.

    Reads only the candidates' probabilities (one small gather per node) and one full row
    for the bonus token. `generator` is a CPU generator."""
    out = Acceptance(path=[0])
    row = 0
    while True:
        kids = children[row]
        cand = [tokens[n] for n in kids]
        p_cand = probs[row, cand].tolist() if cand else []
        remaining, rejected = 1.0, set()
        accepted = None
        for rank, (node, x, px) in enumerate(zip(kids, cand, p_cand)):
            if x in rejected:  # a duplicate candidate: its probability is already zeroed
                continue
            u = torch.rand((), generator=generator).item()
            if remaining > 0 and u * remaining < px:
                accepted = (rank, node, x)
                break
            rejected.add(x)
            remaining -= px
        if accepted is None:
            residual = probs[row].detach().to("cpu", torch.float64).clone()
            if rejected:
                residual[list(rejected)] = 0.0
            if float(residual.sum()) <= 0:  # rounding left no mass: fall back to p
                residual = probs[row].detach().to("cpu", torch.float64)
            out.tokens.append(sample_index(residual, generator))
            return out
        row = out.accept(*accepted)


def accept_sampled_from_draft(children: list[list[int]], tokens: list[int], probs: torch.Tensor,
                              draft_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """SpecInfer's multi-candidate rejection sampling for children drawn i.i.d. from q.

    probs [T, V]: target rows; draft_probs [T, V]: row r is the q the children of row r were
    sampled from. Exact for any q (see the module docstring)."""
    out = Acceptance(path=[0])
    row = 0
    while True:
        p = probs[row].detach().to("cpu", torch.float64).clone()
        q = draft_probs[row].detach().to("cpu", torch.float64)
        accepted = None
        for rank, node in enumerate(children[row]):
            x = tokens[node]
            u = torch.rand((), generator=generator, dtype=torch.float64).item()
            if q[x] > 0 and u * q[x] < p[x]:
                accepted = (rank, node, x)
                break
            p = torch.clamp(p - q, min=0.0)
            if float(p.sum()) <= 0:  # p == q exactly: any later candidate is as good as p
                p = probs[row].detach().to("cpu", torch.float64).clone()
            p = p / p.sum()
        if accepted is None:
            out.tokens.append(sample_index(p, generator))
            return out
        row = out.accept(*accepted)
