"""`adaspec distill-draft` and `adaspec eval-draft`: the steps in order, with checks first.

distill: check the inputs (target loads, has a tokenizer the draft can share, the dataset
exists, the output folder is empty or an earlier draft) -> teacher data (cached, reused) ->
a new draft from the target's embeddings, or the checkpoint with `resume` -> train until
`tokens` or the time budget -> evaluate on held-out prompts -> write the folder and its card.
Nothing is written to the output folder before the last step, and that step is atomic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from distill import draft as draft_mod
from distill import teacher
from distill.card import model_card
from distill.evaluate import DraftEval, evaluate, heldout_sequences
from distill import DistillError
from distill.teacher import TeacherSettings
from distill.train import TrainSettings, TrainState, load_checkpoint, make_optimizer, train
from native_engine.model import ModelLoadError, Transformer, load_model

logger = logging.getLogger(__name__)

TEACHER_PROMPTS = 4000  # train-split prompts tokenised up front (64 per teacher shard)


@dataclass(frozen=True)
class DistillRequest:
    target: str  # embedded name or folder
    out: Path
    shape: draft_mod.DraftShape = draft_mod.DraftShape()
    tokens: int = 2_000_000  # training positions
    budget_minutes: float = 60.0  # whole command, teacher data and evaluation included
    teacher_minutes: float | None = None  # default: 40% of the budget, while the cache is short
    teacher_tokens: int = 400_000  # positions of teacher data wanted in the cache
    resume: bool = False
    dataset: str = "sharegpt"
    eval_prompts: int = 40
    eval_max_new_tokens: int = 128  # target tokens per held-out prompt (twice: T=0 and T=1)
    teacher: TeacherSettings = TeacherSettings()
    train: TrainSettings = TrainSettings()
    work_root: Path | None = None  # teacher cache and checkpoints; default ~/.cache/adaspec/distill
    command_line: str = ""
    text_sequences: int = 0  # dataset conversations added as plain next-token data (0 = none)
    teacher_repeat: int = 3  # target-generated sequences count this many times beside dataset text
    prompts: list[list[int]] | None = None  # token-id prompts instead of a dataset (tests, tokenizer-less)
    eval_prompt_ids: list[list[int]] | None = None
    tokenizer_files: bool = True  # copy the target's tokenizer files into the draft folder


def work_root(request_root: Path | None) -> Path:
    from prepare.models import cache_dir

    return request_root or cache_dir().parent / "distill"


def load_target(reference: str) -> tuple[Path, Transformer]:
    from adaspec.models import ModelError
    from prepare.models import resolve_model

    try:
        folder = Path(resolve_model(reference, prepare=True))
        if not folder.is_dir():
            raise DistillError(f"--target {reference}: a local folder or embedded model is needed "
                               "(the teacher runs in the native engine)")
        return folder, load_model(folder).prepare_for_serving()  # inference only: teacher and evaluation
    except (ModelError, ModelLoadError) as e:
        raise DistillError(f"--target {reference}: {e}") from None


def check_tokenizer(folder: Path, vocab_size: int):
    """The target's tokenizer, refused when its ids do not fit the model's vocabulary (a draft
    with that vocabulary could not represent every token the tokenizer makes)."""
    tok = teacher.load_tokenizer(folder)
    if tok is None:
        raise DistillError(f"--target {folder}: no tokenizer files (tokenizer.json): the draft must share the "
                           "target's tokenizer")
    if len(tok) > vocab_size:
        raise DistillError(f"--target {folder}: tokenizer has {len(tok)} tokens but the model's vocabulary is "
                           f"{vocab_size}; a draft cannot share it")
    return tok


def eos_ids(folder: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


def _run_dir(root: Path, out: Path) -> Path:
    key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:10]
    return root / "runs" / f"{out.name}-{key}"


def distill(req: DistillRequest) -> tuple[Path, DraftEval, TrainState]:
    start = time.monotonic()
    deadline = start + req.budget_minutes * 60
    draft_mod.check_output_folder(req.out)
    folder, target = load_target(req.target)
    root = work_root(req.work_root)
    if req.prompts is None:
        tok = check_tokenizer(folder, target.args.vocab_size)
        train_prompts = teacher.prompt_ids(tok, req.dataset, "train", TEACHER_PROMPTS, seed=0)
        eval_prompts = teacher.prompt_ids(tok, req.dataset, "test", req.eval_prompts, seed=1)
    else:
        train_prompts, eval_prompts = req.prompts, req.eval_prompt_ids or req.prompts[: req.eval_prompts]
    stop = eos_ids(folder)
    fingerprint = teacher.target_fingerprint(folder)

    # 1. teacher data: reuse the cache, top it up within its share of the budget
    cache = root / (f"teacher-{fingerprint}-{req.dataset if req.prompts is None else 'custom'}-"
                    f"{teacher.settings_key(req.teacher)}")
    teacher.open_cache(cache, fingerprint, req.teacher)
    share = req.teacher_minutes if req.teacher_minutes is not None else 0.4 * req.budget_minutes
    have = teacher.generate(target, train_prompts, cache, req.teacher, stop, req.teacher_tokens,
                            min(deadline, time.monotonic() + share * 60))
    seqs = teacher.load_shards(cache)
    logger.info("teacher data: %d sequences, %d positions in %s", len(seqs), have, cache)
    n_teacher = len(seqs)
    if req.text_sequences and req.prompts is None:
        text = teacher.text_sequences(tok, req.dataset, req.text_sequences, req.teacher,
                                      root / f"text-{req.dataset}-{req.text_sequences}.pt")
        logger.info("dataset text: %d sequences, %d positions (next-token targets)", len(text),
                    sum(len(s.topk_ids) for s in text))
        # The target's own data is what matters; repeat it so it is not drowned out.
        seqs = seqs * req.teacher_repeat + text
    if not seqs:
        raise DistillError("no teacher data was generated within the budget; raise --budget-minutes")

    # 2. the draft: fresh from the target's embeddings, or the checkpoint
    run = _run_dir(root, req.out)
    ckpt_path = run / "checkpoint.pt"
    shape = req.shape
    if req.resume and ckpt_path.is_file():
        shape = draft_mod.DraftShape(**torch.load(ckpt_path, weights_only=False)["shape"])
        draft = draft_mod.new_draft(target, shape)
        opt = make_optimizer(draft, req.train)
        state, _ = load_checkpoint(ckpt_path, draft, opt)
        logger.info("resumed from %s: step %d, %d positions seen", ckpt_path, state.step, state.tokens_seen)
    else:
        if req.resume:
            logger.warning("--resume: no checkpoint at %s; starting a new draft", ckpt_path)
        draft = draft_mod.new_draft(target, shape)
        from distill.train import _batch, kd_loss

        scale = draft_mod.calibrate_head_scale(draft, _batch(seqs[:4], req.train.max_len, 1.0), kd_loss)
        logger.info("head scale calibrated to %gx", scale)
        opt, state = make_optimizer(draft, req.train), TrainState()

    # 3. train, leaving a fifth of the budget (at most 10 min) for evaluation and saving
    reserve = min(0.2 * req.budget_minutes * 60, 600)
    train_start = time.monotonic()
    settings = replace(req.train, tokens=req.tokens)
    state = train(draft, seqs, settings, deadline - reserve, ckpt_path, opt, state,
                  {"shape": asdict(shape), "target": fingerprint})
    train_s = time.monotonic() - train_start

    # 4. evaluate on held-out prompts, then write the folder
    heldout = root / (f"eval-{fingerprint}-{req.dataset if req.prompts is None else 'custom'}-{len(eval_prompts)}"
                      f"x{req.eval_max_new_tokens}.pt")
    t0, t1 = heldout_sequences(target, eval_prompts, stop, req.eval_max_new_tokens, heldout)
    result = evaluate(target, draft, t0, t1, req.dataset)
    info = {"target": req.target, "target_fingerprint": fingerprint, "shape": asdict(shape),
            "tokens_seen": state.tokens_seen, "steps": state.step, "train_seconds": round(state.train_seconds),
            "this_run_train_seconds": round(train_s), "teacher_positions": have, "teacher_repeat": req.teacher_repeat, "teacher_sequences": n_teacher,
            "text_sequences": len(seqs) - n_teacher * (req.teacher_repeat if req.text_sequences and req.prompts is None else 1),
            "teacher": asdict(req.teacher), "train": asdict(settings), "final_loss": state.last_loss,
            "final_agreement": state.last_agreement, "tokenizer_files": req.tokenizer_files, "eval": asdict(result), "command": req.command_line}
    card = model_card(req.target, folder, draft, info, result)
    out = draft_mod.save_draft(draft, folder, req.out, card, info, tokenizer=req.tokenizer_files)
    return out, result, state


def eval_draft(target_ref: str, draft_ref: str, dataset: str, prompts: int, max_new_tokens: int = 128,
               root: Path | None = None) -> DraftEval:
    from adaspec.models import ModelError
    from prepare.models import resolve_model

    folder, target = load_target(target_ref)
    try:
        draft_folder = Path(resolve_model(draft_ref, prepare=True))
        draft_mod.check_compatible(folder, draft_folder)
        draft = load_model(draft_folder)
    except (ModelError, ModelLoadError) as e:
        raise DistillError(f"--draft {draft_ref}: {e}") from None
    tok = check_tokenizer(folder, target.args.vocab_size)
    ids = teacher.prompt_ids(tok, dataset, "test", prompts, seed=1)
    fingerprint = teacher.target_fingerprint(folder)
    cache = work_root(root) / f"eval-{fingerprint}-{dataset}-{prompts}x{max_new_tokens}.pt"
    t0, t1 = heldout_sequences(target, ids, eos_ids(folder), max_new_tokens, cache)
    return evaluate(target, draft, t0, t1, dataset)
