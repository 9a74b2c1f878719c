"""Checking a Ray Serve config file before it is deployed.

`serve run` builds an application inside a Ray task that is retried and whose failure
leaves the CLI blocking; checking here first turns a typo into one clear error that names
the application and the field.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

ADASPEC_IMPORT_PATH = "serve_app:build_app"


class ConfigError(ValueError):
    """A Serve config file that cannot be deployed; the message names the field."""


def _format_validation_error(prefix: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        lines.append(f"{prefix}{loc}: {e['msg']}")
    return "\n".join(lines)


def check_serve_config(path: str | Path) -> None:
    """Validate the file with Ray's own ServeDeploySchema, and adaspec apps' `args` with
    AppConfig (model resolved, vLLM engine arguments checked). Raises ConfigError."""
    from ray.serve.schema import ServeDeploySchema

    from adaspec.models import ModelError
    from serve_app.builder import check_ranks_fit
    from serve_app.config import AppConfig

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    try:
        schema = ServeDeploySchema.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(f"{path}:\n" + _format_validation_error("", e)) from None
    for app in schema.applications:
        if app.import_path != ADASPEC_IMPORT_PATH:
            continue
        prefix = f"applications[{app.name}].args."
        try:
            cfg = AppConfig.model_validate(app.args or {})
            cfg.check_engine_kwargs()
            cfg.admin.check_exposure(schema.http_options.host)
        except ValidationError as e:
            raise ConfigError(f"{path}:\n" + _format_validation_error(prefix, e)) from None
        except ValueError as e:
            raise ConfigError(f"{path}: {prefix}{e}") from None
        try:
            cfg.resolve_models()
        except ModelError as e:
            raise ConfigError(f"{prefix}{e}") from None
        try:
            cfg.check_tensor_parallel()
            check_ranks_fit(cfg)
        except ValueError as e:
            raise ConfigError(f"{path}: {prefix}{e}") from None
