"""Teacher data for draft distillation: the target's own continuations and its top-k logits.

A draft model is useful only where it predicts what the *target* will say, so it is trained
on the target's behaviour, not on the dataset's text: prompts (chat-templated ShareGPT user
turns from the "train" split) are continued by the target itself, and at every position,
prompt and continuation alike, the target's top-k log-probabilities for the next token are
kept. Training then minimises the cross-entropy between the draft and that (renormalised,
truncated) distribution: token-level knowledge distillation (Hinton et al. 2015; DistillSpec,
Zhou et al. 2023, found on-policy data plus KD the best recipe for speculative drafters).

Generation runs the target in batches with a KV cache (native_engine.model, fp32): one
prefill over the right-padded prompts, then one decode forward per token for the whole
batch. Batches alternate greedy and T=1 sampling, so the draft sees both the T=0 path it is
measured on and the wider T=1 distribution.

Cache: one shard file per batch under `<cache>/shard-NNNNN.pt`, written atomically, plus
`manifest.json` naming the target and settings. A later run (or `--resume`) reuses every
shard and continues with the next prompts; a manifest for another target or other settings
is an error, not a silent mix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from distill import DistillError
from native_engine.kv_cache import KVCache
from native_engine.attention import causal_mask
from native_engine.model import Transformer

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TeacherSettings:
    top_k: int = 32  # teacher log-probs kept per position (the rest of the mass is dropped)
    max_new_tokens: int = 128  # continuation length per prompt (tokens); serving benchmarks use 128
    max_prompt_tokens: int = 256  # longer prompts keep their first tokens
    # prompts per batch (one shard): larger decodes faster per token (64: ~2x 8 on 2 cores), smaller
    # shards land sooner on a busy machine
    batch_size: int = 32
    sample_every: int = 2  # every n-th batch samples at T=1; the others are greedy
    seed: int = 0


@dataclass
class TeacherSequence:
    """One prompt and its continuation, with the target's next-token top-k at each position."""

    tokens: torch.Tensor  # [L] int32: prompt then continuation
    prompt_len: int  # tokens of the prompt
    topk_ids: torch.Tensor  # [L - 1, K] int32: position t predicts token t + 1
    topk_logprobs: torch.Tensor  # [L - 1, K] float16, natural log


def target_fingerprint(folder: Path) -> str:
    """Identifies a target by its config and weights file sizes (cheap, stable across copies)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def settings_key(settings: TeacherSettings) -> str:
    """A short name for the settings, so caches made with other settings live side by side."""
    return hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode()).hexdigest()[:8]


def open_cache(cache: Path, fingerprint: str, settings: TeacherSettings) -> None:
    """Create the cache folder, or check that an existing one holds data for this target."""
    cache.mkdir(parents=True, exist_ok=True)
    manifest = cache / MANIFEST
    wanted = {"target": fingerprint, "settings": asdict(settings)}
    if manifest.is_file():
        have = json.loads(manifest.read_text())
        if have != wanted:
            raise DistillError(f"teacher cache {cache} holds data for another target or other settings "
                               f"({have}); use another --teacher-cache")
    else:
        manifest.write_text(json.dumps(wanted, indent=2))


def shards(cache: Path) -> list[Path]:
    return sorted(cache.glob("shard-*.pt"))


def load_shards(cache: Path) -> list[TeacherSequence]:
    seqs: list[TeacherSequence] = []
    for path in shards(cache):
        seqs.extend(TeacherSequence(**row) for row in torch.load(path, weights_only=True))
    return seqs


def cached_positions(cache: Path) -> int:
    """Training positions (tokens with a teacher target) in the cache."""
    total = 0
    for path in shards(cache):
        total += sum(int(row["topk_ids"].shape[0]) for row in torch.load(path, weights_only=True))
    return total


@torch.no_grad()
def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k next-token log-probs of logits [N, V] -> ids [N, K] int32, logprobs [N, K] fp16."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.topk(k, dim=-1)
    return top.indices.to(torch.int32), top.values.to(torch.float16)


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], settings: TeacherSettings,
                   temperature: float, eos_ids: frozenset[int], generator: torch.Generator
                   ) -> list[TeacherSequence]:
    """Continue every prompt with the target; record its top-k at every position."""
    B, k = len(prompts), settings.top_k
    prompts = [p[: settings.max_prompt_tokens] for p in prompts]
    lengths = torch.tensor([len(p) for p in prompts])
    Tp = int(lengths.max())
    a = model.args
    max_len = Tp + settings.max_new_tokens + 1
    cache = KVCache.allocate(a.n_layers, B, a.n_kv_heads, max_len, a.head_dim,
                             model.lm_head.weight.dtype, model.lm_head.weight.device)

    # prefill: right-padded prompts, each token at its own position
    tokens = torch.zeros((B, Tp), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    pos = torch.arange(Tp)[None].expand(B, Tp)
    hidden = model(tokens, pos, causal_mask(lengths, Tp), cache, 0, pos, Tp)  # [B, Tp, D]
    ids_parts: list[list[torch.Tensor]] = [[] for _ in range(B)]
    lp_parts: list[list[torch.Tensor]] = [[] for _ in range(B)]
    last = torch.zeros((B, a.dim), dtype=hidden.dtype)
    for b in range(B):
        L = int(lengths[b])
        i, v = _topk(model.logits(hidden[b, :L]), k)  # [L, K]
        ids_parts[b].append(i)
        lp_parts[b].append(v)
        last[b] = hidden[b, L - 1]
    del hidden

    # decode: one token per row per forward until every row has finished
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    cur = lengths.clone()  # next cache position per row
    logits = model.logits(last)  # [B, V]
    for step in range(settings.max_new_tokens):
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        for b in range(B):
            if not done[b]:
                out[b].append(int(nxt[b]))
                done[b] = int(nxt[b]) in eos_ids
        if bool(done.all()) or step == settings.max_new_tokens - 1:
            break
        key_len = int(cur.max()) + 1
        mask = (torch.arange(key_len)[None, :] <= cur[:, None])[:, None, None, :]  # [B, 1, 1, S]
        h = model(nxt[:, None], cur[:, None], mask, cache, 0, cur[:, None], key_len)[:, 0]  # [B, D]
        logits = model.logits(h)  # [B, V], once: the lm_head is a large share of a decode step
        i, v = _topk(logits, k)
        for b in range(B):
            if not done[b]:
                ids_parts[b].append(i[b: b + 1])
                lp_parts[b].append(v[b: b + 1])
        cur = cur + 1

    seqs = []
    for b in range(B):
        toks = torch.tensor(prompts[b] + out[b], dtype=torch.int32)
        ids, lps = torch.cat(ids_parts[b]), torch.cat(lp_parts[b])
        n = len(toks) - 1  # positions with a next token
        seqs.append(TeacherSequence(toks, len(prompts[b]), ids[:n].contiguous(), lps[:n].contiguous()))
    return seqs


def generate(model: Transformer, prompts: list[list[int]], cache: Path, settings: TeacherSettings,
             eos_ids: frozenset[int], want_positions: int, deadline: float) -> int:
    """Fill the cache up to `want_positions` training positions or until `deadline`
    (time.monotonic seconds); batches already cached are skipped. Returns positions cached."""
    have = cached_positions(cache)
    done_batches = len(shards(cache))
    n_batches = (len(prompts) + settings.batch_size - 1) // settings.batch_size
    gen = torch.Generator().manual_seed(settings.seed)
    start, made = time.monotonic(), 0
    for i in range(done_batches, n_batches):
        if have >= want_positions or time.monotonic() >= deadline:
            break
        gen.manual_seed(settings.seed + i)  # each batch reproducible on its own
        batch = prompts[i * settings.batch_size: (i + 1) * settings.batch_size]
        temperature = 1.0 if (i % settings.sample_every) == settings.sample_every - 1 else 0.0
        seqs = generate_batch(model, batch, settings, temperature, eos_ids, gen)
        path = cache / f"shard-{i:05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save([asdict(s) for s in seqs], tmp)
        tmp.replace(path)
        n = sum(int(s.topk_ids.shape[0]) for s in seqs)
        gen_tokens = sum(len(s.tokens) - s.prompt_len for s in seqs)
        have += n
        made += n
        rate = made / max(time.monotonic() - start, 1e-9)
        logger.info("teacher shard %d: %d prompts, %d positions (%d generated, T=%g); cache %d/%d positions, "
                    "%.0f positions/s", i, len(batch), n, gen_tokens, temperature, have, want_positions, rate)
    return have


def load_tokenizer(folder: Path):
    """The Hugging Face tokenizer of a model folder, or None when the folder has none."""
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def prompt_ids(tokenizer, dataset: str, split: str, num_prompts: int | None, seed: int = 0,
               max_chars: int = 1500) -> list[list[int]]:
    """Dataset prompts as the target sees them when served: chat-templated user turns
    (ShareGPT) or raw code prefixes (HumanEval), token ids."""
    from adaspec.datasets import DatasetError
    from prepare.datasets import load_prompts

    try:
        # All prompts in the seeded order, then the first n: the same n prompts whatever n, and
        # a dataset smaller than n gives all it has.
        prompts = load_prompts(dataset, None, seed=seed, split=split)[:num_prompts]
    except DatasetError as e:
        raise DistillError(f"--dataset: {e}") from None
    if not prompts:
        raise DistillError(f"--dataset: {dataset} has no {split} prompts")
    out = []
    for p in prompts:
        text = p.text[:max_chars]
        if p.chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer.encode(text)
        out.append(list(ids))
    return out


def text_sequences(tokenizer, dataset: str, num: int, settings: TeacherSettings, cache: Path | None = None
                   ) -> list[TeacherSequence]:
    """The dataset's own conversations (user turn + reference answer, chat-templated), as
    one-hot 'teacher' targets: plain next-token training, a warm start that costs no target
    compute. Target-generated data is what the draft must match; this only teaches it the
    language cheaply where CPU time for the teacher is short. Cached in `cache` when given."""
    from adaspec.datasets import DatasetError
    from prepare.datasets import load_prompts

    if cache is not None and cache.is_file():
        return [TeacherSequence(**row) for row in torch.load(cache, weights_only=True)]
    try:
        prompts = load_prompts(dataset, None, seed=0, split="train")[:num]
    except DatasetError as e:
        raise DistillError(f"--dataset: {e}") from None
    seqs, k = [], settings.top_k
    limit = settings.max_prompt_tokens + settings.max_new_tokens
    for p in prompts:
        if p.chat and getattr(tokenizer, "chat_template", None):
            user = [{"role": "user", "content": p.text[:1500]}]
            head = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": p.reference_output[:2000]}],
                                                 tokenize=True, return_dict=False)
        else:
            head, full = tokenizer.encode(p.text), tokenizer.encode(p.text + p.reference_output)
        head = list(head["input_ids"] if hasattr(head, "keys") else head)
        full = list(full["input_ids"] if hasattr(full, "keys") else full)
        prompt_len = min(len(head), settings.max_prompt_tokens)
        full = full[:prompt_len] + full[len(head): len(head) + settings.max_new_tokens]  # same shape as teacher data
        full = full[:limit]
        if len(full) < 2:
            continue
        toks = torch.tensor(full, dtype=torch.int32)
        ids = torch.zeros((len(full) - 1, k), dtype=torch.int32)
        ids[:, 0] = toks[1:]
        lps = torch.full((len(full) - 1, k), -1e4, dtype=torch.float16)
        lps[:, 0] = 0.0
        seqs.append(TeacherSequence(toks, prompt_len, ids, lps))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        torch.save([asdict(s) for s in seqs], tmp)
        tmp.replace(cache)
    return seqs
