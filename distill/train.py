"""Training the draft on the teacher's top-k next-token distributions.

Loss at a position: cross-entropy from the teacher's top-k probabilities (renormalised to
sum to one) to the draft's full softmax, i.e. forward KL to the truncated teacher up to a
constant. Prompt positions count `prompt_weight` (the draft drafts answers, not prompts, but
prompts are cheap extra data); continuation positions count 1.

The learning rate warms up, then follows a cosine to 10% over the *planned* tokens: the
`--tokens` asked for, shrunk to what the measured throughput can reach before the deadline
(re-estimated at every checkpoint), so a time-limited run still ends on a low learning rate.

Checkpoints (model, optimiser, counters) are written atomically every `checkpoint_every_s`
and at the end; `resume=True` continues from one, `tokens` then being the new total.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distill.teacher import TeacherSequence
from native_engine.attention import causal_mask
from native_engine.model import Transformer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    tokens: int = 2_000_000  # training positions to see in total (over epochs of the teacher data)
    batch_sequences: int = 8  # sequences per step (~2,000 positions with 256 + 128 tokens each)
    max_len: int = 384  # tokens per sequence (longer ones are cut)
    lr: float = 2e-3  # layers, norms
    # The tied embedding/head starts from the target's; 0 keeps it frozen, which skips its
    # weight gradient (~1/3 of a step's cost on CPU) and leaves the few layers to learn.
    embed_lr: float = 0.0
    warmup_steps: int = 20
    weight_decay: float = 0.01
    prompt_weight: float = 0.3
    checkpoint_every_s: float = 120.0
    seed: int = 0


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0  # positions trained on (all runs)
    train_seconds: float = 0.0  # wall time spent training (all runs)
    planned_tokens: int = 0
    last_loss: float = float("nan")
    last_agreement: float = float("nan")  # draft argmax == teacher argmax, last logging window


def _batch(seqs: list[TeacherSequence], max_len: int, prompt_weight: float):
    """Right-padded tokens [B, T], lengths [B], and per-position top-k targets and weights."""
    B = len(seqs)
    lens = [min(len(s.tokens), max_len) for s in seqs]
    T = max(lens)
    K = seqs[0].topk_ids.shape[1]
    tokens = torch.zeros((B, T), dtype=torch.long)
    ids = torch.zeros((B, T, K), dtype=torch.long)
    lps = torch.full((B, T, K), -1e4)
    weight = torch.zeros((B, T))
    for b, (s, n) in enumerate(zip(seqs, lens)):
        tokens[b, :n] = s.tokens[:n].long()
        ids[b, : n - 1] = s.topk_ids[: n - 1].long()
        lps[b, : n - 1] = s.topk_logprobs[: n - 1].float()
        weight[b, : n - 1] = 1.0
        weight[b, : min(s.prompt_len - 1, n - 1)] = prompt_weight
    return tokens, torch.tensor(lens), ids, lps, weight


def kd_loss(draft: Transformer, tokens, lengths, ids, lps, weight) -> tuple[torch.Tensor, float]:
    """Weighted mean cross-entropy to the renormalised teacher top-k; also the top-1 agreement."""
    B, T = tokens.shape
    pos = torch.arange(T)[None].expand(B, T)
    hidden = draft(tokens, pos, causal_mask(lengths, T))  # [B, T, D]
    sel = weight > 0  # [B, T]
    logq = torch.log_softmax(draft.logits(hidden[sel]), dim=-1)  # [N, V]
    p = torch.softmax(lps[sel], dim=-1)  # [N, K]
    per_pos = -(p * logq.gather(1, ids[sel])).sum(-1)  # [N]
    w = weight[sel]
    with torch.no_grad():
        agree = float(((logq.argmax(-1) == ids[sel][:, 0]).float() * w).sum() / w.sum())
    return (per_pos * w).sum() / w.sum(), agree


def _lr_factor(state: TrainState, settings: TrainSettings) -> float:
    if state.step < settings.warmup_steps:
        return (state.step + 1) / settings.warmup_steps
    progress = min(1.0, state.tokens_seen / max(state.planned_tokens, 1))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(draft: Transformer, settings: TrainSettings) -> torch.optim.Optimizer:
    embed = draft.model.embed_tokens.weight
    embed.requires_grad_(settings.embed_lr > 0)
    # Norm gains set the logits' scale, which starts small (calibrate_head_scale); at the
    # layers' rate they would take hundreds of steps to grow, so they learn 10x faster.
    norms = [p for n, p in draft.named_parameters() if "norm" in n]
    rest = [p for n, p in draft.named_parameters() if p is not embed and "norm" not in n]
    groups = [{"params": rest, "lr": settings.lr, "base_lr": settings.lr},
              {"params": norms, "lr": 10 * settings.lr, "base_lr": 10 * settings.lr, "weight_decay": 0.0}]
    if settings.embed_lr > 0:
        groups.append({"params": [embed], "lr": settings.embed_lr, "base_lr": settings.embed_lr})
    return torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=settings.weight_decay)


def save_checkpoint(path: Path, draft: Transformer, opt, state: TrainState, extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "state": asdict(state), **extra}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, draft: Transformer, opt) -> tuple[TrainState, dict]:
    ckpt = torch.load(path, weights_only=False)
    draft.load_state_dict(ckpt.pop("model"))
    opt.load_state_dict(ckpt.pop("optimizer"))
    return TrainState(**ckpt.pop("state")), ckpt


def train(draft: Transformer, seqs: list[TeacherSequence], settings: TrainSettings, deadline: float,
          checkpoint: Path, opt=None, state: TrainState | None = None, extra: dict | None = None) -> TrainState:
    """Train until `settings.tokens` positions are seen or `deadline` (time.monotonic seconds)."""
    from tqdm import tqdm

    if not seqs:
        raise ValueError("no teacher data to train on")
    opt = opt or make_optimizer(draft, settings)
    state = state or TrainState()
    extra = extra or {}
    state.planned_tokens = settings.tokens
    draft.train()
    gen = torch.Generator().manual_seed(settings.seed + state.step)
    order = torch.randperm(len(seqs), generator=gen).tolist()
    cursor = 0
    run_start = time.monotonic()
    run_tokens0 = state.tokens_seen
    last_ckpt = last_log = run_start
    window_loss, window_agree, window_n = 0.0, 0.0, 0
    tty = sys.stderr.isatty()
    bar = tqdm(total=settings.tokens, initial=state.tokens_seen, unit="tok", unit_scale=True,
               desc="distill", mininterval=1 if tty else 60, file=sys.stderr, dynamic_ncols=True)
    while state.tokens_seen < settings.tokens and time.monotonic() < deadline:
        if cursor + settings.batch_sequences > len(order):
            order, cursor = torch.randperm(len(seqs), generator=gen).tolist(), 0
        batch = [seqs[i] for i in order[cursor: cursor + settings.batch_sequences]]
        cursor += settings.batch_sequences
        tokens, lengths, ids, lps, weight = _batch(batch, settings.max_len, settings.prompt_weight)
        factor = _lr_factor(state, settings)
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor
        loss, agree = kd_loss(draft, tokens, lengths, ids, lps, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], 1.0)
        opt.step()
        n = int((weight > 0).sum())
        state.step += 1
        state.tokens_seen += n
        window_loss, window_agree, window_n = window_loss + float(loss.detach()), window_agree + agree, window_n + 1
        now = time.monotonic()
        rate = (state.tokens_seen - run_tokens0) / max(now - run_start, 1e-9)  # positions/s
        bar.update(n)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", agree=f"{agree:.3f}", tok_s=f"{rate:.0f}", refresh=False)
        if now - last_log >= 60 or state.tokens_seen >= settings.tokens:
            state.last_loss, state.last_agreement = window_loss / window_n, window_agree / window_n
            logger.info("step %d: %d/%d positions (planned %d), loss %.3f, top-1 agreement %.3f, %.0f positions/s, "
                        "lr x%.2f", state.step, state.tokens_seen, settings.tokens, state.planned_tokens,
                        state.last_loss, state.last_agreement, rate, factor)
            window_loss, window_agree, window_n, last_log = 0.0, 0.0, 0, now
        if now - last_ckpt >= settings.checkpoint_every_s:
            # Shrink the plan to what the remaining time allows, so the cosine ends in time.
            reachable = state.tokens_seen + int(rate * max(deadline - now, 0))
            state.planned_tokens = max(state.tokens_seen, min(settings.tokens, reachable))
            state.train_seconds += now - last_ckpt
            save_checkpoint(checkpoint, draft, opt, state, extra)
            last_ckpt = now
    bar.close()
    state.train_seconds += time.monotonic() - last_ckpt
    if window_n:
        state.last_loss, state.last_agreement = window_loss / window_n, window_agree / window_n
    save_checkpoint(checkpoint, draft, opt, state, extra)
    draft.eval()
    return state
