"""Training data for an EAGLE-3 head: the target's features and next-token predictions.

An EAGLE-3 head reads the residual stream entering three target layers, so its training data
is the target's forward pass over text: for every position, those three hidden states
(`aux`, kept in bfloat16) and the target's top-k next-token log-probabilities (the soft labels
the head learns to match). The text is chat-templated ShareGPT conversations and code from
the train splits (`distill.teacher.text_sequences`), plus the target's own continuations where
the run has time for them (`distill.teacher.generate`: what the head meets when serving).

The forward pass is Hugging Face's implementation of the target (`output_hidden_states`):
vLLM loads the same weights, and its aux layer id n is Hugging Face's `hidden_states[n]`.

Cache: one shard per batch under the given folder, written atomically, with a manifest naming
the target and settings; a later run reuses every shard.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distill import DistillError
from distill.teacher import TeacherSequence

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass
class FeatureSequence:
    tokens: torch.Tensor  # [L] int32
    prompt_len: int
    aux: torch.Tensor  # [L, 3 x hidden] bfloat16: the residual stream entering each aux layer
    topk_ids: torch.Tensor  # [L, K] int32: the target's top-k next tokens at each position
    topk_logprobs: torch.Tensor  # [L, K] float16, natural log


@dataclass(frozen=True)
class FeatureSettings:
    aux_layers: tuple[int, ...]
    top_k: int = 32
    tokens_per_batch: int = 3072  # one forward pass (padded tokens); one shard


def load_target_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.inference_mode()
def features(model, seqs: list[TeacherSequence], settings: FeatureSettings) -> list[FeatureSequence]:
    """One right-padded forward pass over `seqs`."""
    lengths = [len(s.tokens) for s in seqs]
    L = max(lengths)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : lengths[b]] = s.tokens.long()
        mask[b, : lengths[b]] = 1
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[n] for n in settings.aux_layers], dim=-1)
    top = torch.log_softmax(out.logits.float(), dim=-1).topk(settings.top_k, dim=-1)
    return [FeatureSequence(s.tokens.to(torch.int32), s.prompt_len, aux[b, :n].to(torch.bfloat16).clone(),
                            top.indices[b, :n].to(torch.int32).clone(), top.values[b, :n].to(torch.float16).clone())
            for b, (s, n) in enumerate(zip(seqs, lengths))]


def length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped by length, shortest first, so that a padded batch stays within
    `tokens_per_batch` and padding stays small."""
    out, cur = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > tokens_per_batch:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def build(target_folder: Path, seqs: list[TeacherSequence], cache: Path, settings: FeatureSettings,
          fingerprint: str) -> list[FeatureSequence]:
    """Features of every sequence, shard by shard (cached shards are reused)."""
    cache.mkdir(parents=True, exist_ok=True)
    manifest = {"target": fingerprint, "settings": asdict(settings), "sequences": len(seqs)}
    path = cache / MANIFEST
    if path.is_file() and json.loads(path.read_text()) != json.loads(json.dumps(manifest)):
        raise DistillError(f"{cache}: features of another target or other settings; delete it or use another folder")
    path.write_text(json.dumps(manifest, indent=2))
    groups = [[seqs[i] for i in b] for b in length_batches([len(s.tokens) for s in seqs], settings.tokens_per_batch)]
    model, out, start, done = None, [], time.monotonic(), 0
    total = sum(len(s.tokens) for s in seqs)
    for i, group in enumerate(groups):
        shard = cache / f"shard-{i:05d}.pt"
        if shard.is_file():
            part = [FeatureSequence(**row) for row in torch.load(shard, weights_only=True)]
        else:
            model = model or load_target_hf(target_folder)
            part = features(model, group, settings)
            tmp = shard.with_suffix(".tmp")
            torch.save([asdict(f) for f in part], tmp)
            tmp.replace(shard)
        out.extend(part)
        done += sum(len(s.tokens) for s in group)
        if i % 10 == 0 or i == len(groups) - 1:
            rate = done / max(time.monotonic() - start, 1e-9)
            logger.info("features: batch %d/%d, %d/%d positions, %.0f positions/s", i + 1, len(groups), done,
                        total, rate)
    return out


def choose_vocabulary(data: list[FeatureSequence], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` target tokens the target predicts most often (its top-1 at response positions,
    then any position, then the text itself), sorted; and the share of response-position top-1
    predictions they cover."""
    top1_resp = torch.zeros(vocab_size, dtype=torch.float64)
    other = torch.zeros(vocab_size, dtype=torch.float64)
    for f in data:
        start = max(f.prompt_len - 1, 0)
        top1_resp += torch.bincount(f.topk_ids[start:, 0].long(), minlength=vocab_size).double()
        other += torch.bincount(f.topk_ids[:, 0].long(), minlength=vocab_size).double()
        other += torch.bincount(f.tokens.long(), minlength=vocab_size).double()
    score = top1_resp * 1e6 + other  # response predictions first, the rest breaks ties
    ids = score.topk(size).indices.sort().values
    coverage = float(top1_resp[ids].sum() / top1_resp.sum().clamp(min=1))
    return ids, coverage
