"""Training an EAGLE-3 head: training-time test over the target's features, KD loss.

Each batch runs the head `steps` draft steps from every position at once
(`Eagle3Head.unrolled`), so it learns from its own outputs as it will meet them when drafting
the second and later tokens of a chain (EAGLE-3's "training-time test"). The loss at every step
is the cross-entropy between the head's draft-vocabulary distribution and the target's top-k
next-token distribution restricted to the draft vocabulary and renormalised; later steps weigh
less (they are reached only when the earlier ones are accepted).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field

import torch

from distill.eagle3_data import FeatureSequence, length_batches
from native_engine.eagle3 import Eagle3Head

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadTrainSettings:
    steps: int = 3  # draft steps unrolled per position (training-time test)
    step_decay: float = 0.8  # weight of draft step s: decay ** s
    tokens_per_batch: int = 2048
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    prompt_weight: float = 0.1  # positions predicting a prompt token
    seed: int = 0


@dataclass
class HeadTrainState:
    step: int = 0
    positions: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)  # step-0 agreement with the target's top-1, per log line


def init_from_target(head: Eagle3Head, target_state: dict[str, torch.Tensor], seed: int = 0) -> None:
    """lm_head rows = the target's output embeddings of the draft vocabulary, final norm = the
    target's; the layer and fc start random (small), as EAGLE-3's recipe does."""
    g = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
    lm = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"])
    head.lm_head.weight.data.copy_(lm[head.target_ids()])
    head.norm.weight.data.copy_(target_state["model.norm.weight"])


def collate(data: list[FeatureSequence], idx: list[int], steps: int, draft_index: torch.Tensor,
            prompt_weight: float):
    """Padded tensors for `Eagle3Head.unrolled` and the labels of each step.

    Slot i of step s predicts token i + 2 + s from the target's distribution at position
    i + 1 + s; it exists while that position does (i + 1 + s <= length - 1)."""
    seqs = [data[i] for i in idx]
    B, L = len(seqs), max(len(s.tokens) for s in seqs)
    K = seqs[0].topk_ids.shape[1]
    aux = torch.zeros((B, L, seqs[0].aux.shape[1]), dtype=torch.float32)
    tokens = torch.zeros((B, L + steps), dtype=torch.long)
    ids = torch.zeros((B, L + steps, K), dtype=torch.long)
    lps = torch.full((B, L + steps, K), -1e4, dtype=torch.float32)
    weight = torch.zeros((steps, B, L))
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        aux[b, :n] = s.aux.float()
        tokens[b, :n] = s.tokens.long()
        ids[b, :n] = s.topk_ids.long()
        lps[b, :n] = s.topk_logprobs.float()
        for step in range(steps):
            valid = max(n - 1 - step, 0)  # slots 0 .. valid-1
            w = torch.ones(valid)
            predicted = torch.arange(valid) + 2 + step  # the token each slot predicts
            w[predicted < s.prompt_len] = prompt_weight
            weight[step, b, :valid] = w
    draft = draft_index[ids]  # [B, L+steps, K] draft id, -1 outside the draft vocabulary
    probs = torch.where(draft >= 0, lps.exp(), torch.zeros(()))
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
    return aux, tokens, draft.clamp(min=0), probs, weight


def head_loss(head: Eagle3Head, embed: torch.nn.Embedding, batch, settings: HeadTrainSettings):
    aux, tokens, draft, probs, weight = batch
    L = aux.shape[1]
    steps = settings.steps
    with torch.no_grad():
        embeds = embed(tokens[:, 1:L + steps])  # tokens 1 .. L + steps - 1
    outs = head.unrolled(aux, embeds, steps)
    total, norm, agree = 0.0, 0.0, (0.0, 0.0)
    for s, out in enumerate(outs):
        logq = torch.log_softmax(head.logits(out).float(), dim=-1)  # [B, L, Vd]
        tgt_ids, tgt_p = draft[:, 1 + s:1 + s + L], probs[:, 1 + s:1 + s + L]
        ce = -(tgt_p * logq.gather(-1, tgt_ids)).sum(-1)  # [B, L]
        w = weight[s] * settings.step_decay ** s
        total = total + (ce * w).sum()
        norm += float(w.sum())
        if s == 0:
            hit = (logq.argmax(-1) == tgt_ids[..., 0]).float()
            agree = (float((hit * (weight[0] == 1)).sum()), float((weight[0] == 1).sum()))
    return total / max(norm, 1e-9), agree


def train(head: Eagle3Head, embed: torch.nn.Embedding, data: list[FeatureSequence], settings: HeadTrainSettings,
          deadline: float, epochs: float, state: HeadTrainState | None = None) -> HeadTrainState:
    """Train until `epochs` passes over `data` or `deadline` (time.monotonic), cosine schedule."""
    state = state or HeadTrainState()
    rng = random.Random(settings.seed)
    draft_index = torch.full((head.args.target.vocab_size,), -1, dtype=torch.long)
    draft_index[head.target_ids()] = torch.arange(head.args.draft_vocab_size)
    per_epoch = length_batches([len(f.tokens) for f in data], settings.tokens_per_batch)
    rng.shuffle(per_epoch)
    planned = max(int(len(per_epoch) * epochs), 1)
    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                            betas=(0.9, 0.95))
    head.train()
    start, queue, log_loss, log_agree = time.monotonic(), [], [], [0.0, 0.0]
    while state.step < planned and time.monotonic() < deadline:
        if not queue:
            queue = list(per_epoch)
            rng.shuffle(queue)
        idx = queue.pop()
        # The schedule ends with whichever comes first, the planned steps or the deadline, so a
        # run the budget cuts short still anneals.
        progress = max(state.step / planned, (time.monotonic() - start) / max(deadline - start, 1e-9))
        lr = settings.lr * min(1.0, (state.step + 1) / settings.warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = collate(data, idx, settings.steps, draft_index, settings.prompt_weight)
        loss, agree = head_loss(head, embed, batch, settings)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        state.step += 1
        state.positions += sum(len(data[i].tokens) for i in idx)
        log_loss.append(float(loss.detach()))
        log_agree[0] += agree[0]
        log_agree[1] += agree[1]
        if state.step % 25 == 0 or state.step == planned:
            elapsed = time.monotonic() - start
            state.losses.append(sum(log_loss) / len(log_loss))
            state.top1.append(log_agree[0] / max(log_agree[1], 1.0))
            logger.info("head step %d/%d: loss %.3f, top-1 agreement (step 0, response) %.3f, lr %.2e, "
                        "%.0f positions/s", state.step, planned, state.losses[-1], state.top1[-1], lr,
                        state.positions / max(elapsed + state.seconds, 1e-9))
            log_loss, log_agree = [], [0.0, 0.0]
    state.seconds += time.monotonic() - start
    head.eval()
    return state
