"""The model card (README.md) of a distilled draft: what it is, what it saw, how good it is."""

from __future__ import annotations

from pathlib import Path

from distill.evaluate import DraftEval, format_rate
from native_engine.model import Transformer

# The goals of issue 7, printed beside the measured numbers.
GOAL_ACCEPT_1 = 0.6  # acceptance at position 1, T=0
GOAL_LENGTH_K4 = 2.2  # mean accepted length at k=4, T=0
GOAL_COST = 0.12  # draft / target cost per token


def goal_lines(result: DraftEval) -> list[str]:
    rows = [("acceptance at position 1 (T=0)", result.acceptance_t0[0] or 0.0, GOAL_ACCEPT_1, True),
            ("mean accepted length, k=4 (T=0)", result.mean_accepted_length_t0[4], GOAL_LENGTH_K4, True),
            ("cost ratio draft/target per token", result.cost_ratio, GOAL_COST, False)]
    out = []
    for name, value, goal, higher in rows:
        met = value >= goal if higher else value <= goal
        gap = "met" if met else f"missed by {abs(value - goal):.3f}"
        out.append(f"| {name} | {value:.3f} | {'>=' if higher else '<='} {goal} | {gap} |")
    return out


def model_card(target_ref: str, target_folder: Path, draft: Transformer, info: dict, result: DraftEval) -> str:
    a = draft.args
    params = sum(p.numel() for n, p in draft.named_parameters() if n != "lm_head.weight")
    shape = info["shape"]
    lines = [
        f"# Draft model for {target_ref}",
        "",
        f"A {a.n_layers}-layer Llama trained by `adaspec distill-draft` to draft for `{target_ref}` in speculative "
        "decoding (vLLM `method: draft_model`, adaspec's native tree engine). It shares the target's tokenizer "
        "and vocabulary" + ("; the tokenizer files here are the target's." if info.get("tokenizer_files", True) else
        f" (its tokenizer files are left out to stay small: use `{target_ref}`'s; vLLM and the native engine do)."),
        "",
        "## Architecture",
        f"- LlamaForCausalLM: {a.n_layers} layers, hidden {a.dim}, {a.n_heads} heads ({a.n_kv_heads} KV heads, "
        f"head dim {a.head_dim}), MLP {a.intermediate_size}, vocabulary {a.vocab_size}, tied embeddings, "
        f"RoPE theta {a.rope_theta:g}; {params / 1e6:.1f} M parameters, stored in bfloat16.",
        f"- Initialised from the target: embeddings = the target's projected onto their top {a.dim} principal "
        "directions; layers random.",
        "",
        "## Training data",
        f"- Teacher: the target itself. {info['teacher_sequences']} chat-templated ShareGPT prompts (train split; "
        f"first {info['teacher']['max_prompt_tokens']} tokens) continued by the target for up to "
        f"{info['teacher']['max_new_tokens']} tokens (alternate batches greedy and T=1), with the target's top "
        f"{info['teacher']['top_k']} next-token log-probabilities at every position: "
        f"{info['teacher_positions']:,} positions.",
        *([f"- Plus {info['text_sequences']} ShareGPT conversations (user turn + the dataset's answer, same "
            "truncation) with plain next-token targets: a cheap warm start where CPU time for the teacher was short; "
            f"target-generated sequences repeated {info.get('teacher_repeat', 3)}x beside them."]
          if info.get("text_sequences") else []),
        "- Loss: cross-entropy to the renormalised teacher top-k (token-level knowledge distillation); prompt "
        f"positions weighted {info['train']['prompt_weight']}.",
        f"- Seen: {info['tokens_seen']:,} positions in {info['steps']} steps, "
        f"{info['train_seconds'] / 60:.0f} min of training on this machine's CPU (2 cores, shared); final loss "
        f"{info['final_loss']:.3f}, top-1 agreement with the target {info['final_agreement']:.3f}.",
        "",
        f"## Measured (`adaspec eval-draft`, {result.prompts} held-out {result.dataset} prompts, "
        f"{result.generated_tokens_t0} target tokens)",
        "",
        "| position | " + " | ".join(str(i) for i in range(1, 9)) + " |",
        "|---|" + "---|" * 8,
        "| acceptance T=0 | " + " | ".join(format_rate(v) for v in result.acceptance_t0) + " |",
        "| acceptance T=1 | " + " | ".join(format_rate(v) for v in result.acceptance_t1) + " |",
        "",
        "| k | " + " | ".join(str(k) for k in result.mean_accepted_length_t0) + " |",
        "|---|" + "---|" * 8,
        "| mean accepted length T=0 | " + " | ".join(f"{v:.2f}" for v in result.mean_accepted_length_t0.values()) + " |",
        "| mean accepted length T=1 | " + " | ".join(f"{v:.2f}" for v in result.mean_accepted_length_t1.values()) + " |",
        "",
        f"Cost per token (batch-1 decode forward, native engine, fp32): draft {result.draft_ms:.2f} ms, target "
        f"{result.target_ms:.2f} ms, ratio {result.cost_ratio:.3f}.",
        "",
        "| goal | measured | wanted | |",
        "|---|---|---|---|",
        *goal_lines(result),
        "",
        "## Command",
        "",
        f"```\n{info['command'] or '(library call)'}\n```",
        "",
        f"Shape flags: --layers {shape['layers']} --hidden {shape['hidden']}. Continue training with the same "
        "command and `--resume` (the checkpoint lives under ~/.cache/adaspec/distill/runs/).",
        "",
    ]
    return "\n".join(lines)
