"""The embedded model: resolution, idempotent preparation, recovery from an interrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaspec import models
from adaspec.models import MARKER_FILE, ModelError
from prepare.models import is_complete, model_folder, prepare_model, resolve_model


def test_resolve_references(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    folder = tmp_path / "my-model"
    folder.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(folder))
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == str(folder.resolve())
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./missing-folder")
    with pytest.raises(ModelError, match="not an embedded model"):
        resolve_model("smollm2-135m-instrct")
    with pytest.raises(ModelError, match="not prepared"):
        resolve_model("smollm2-135m-instruct", prepare=False)


def test_completeness_needs_the_marker_and_every_listed_file(tmp_path):
    assert not is_complete(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / MARKER_FILE).write_text(json.dumps({"files": ["config.json", "model.safetensors"]}))
    assert not is_complete(tmp_path)  # the weights are missing
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert is_complete(tmp_path)


def test_prepared_model_is_reused():
    """The session's model (prepared by the installer) is returned untouched, not converted again."""
    folder = prepare_model("smollm2-135m-instruct")
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("smollm2-135m-instruct") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30


@pytest.mark.slow
def test_interrupted_preparation_is_detected_and_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE_DIR", str(tmp_path))
    folder = model_folder("smollm2-135m-instruct")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # what a killed run might leave: no marker
    assert prepare_model("smollm2-135m-instruct") == folder
    assert is_complete(folder)
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 576
    assert not list(Path(tmp_path).glob(".*partial*"))


def test_unknown_embedded_model():
    with pytest.raises(ModelError, match="unknown embedded model"):
        prepare_model("no-such-model")
    assert "smollm2-135m-instruct" in models.EMBEDDED_MODELS
