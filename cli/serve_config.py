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
RAY_LLM_IMPORT_PATH = "serve_app:build_openai_app"  # Ray Serve LLM's args (serve_app/ray_serving_args.py)


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
    AppConfig, or as Ray Serve LLM's args (model resolved, vLLM engine arguments checked).
    Raises ConfigError."""
    from ray.serve.schema import ServeDeploySchema

    from serve_app.builder import check_can_start
    from serve_app.config import AppConfig
    from serve_app.ray_serving_args import in_ray_terms, read_serving_args

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
        if app.import_path not in (ADASPEC_IMPORT_PATH, RAY_LLM_IMPORT_PATH):
            continue
        prefix = f"applications[{app.name}].args."
        try:
            if app.import_path == RAY_LLM_IMPORT_PATH:
                models = read_serving_args(app.args or {}).models
                configs = [(f"llm_configs[{i}].", m.app) for i, m in enumerate(models)]
            else:
                configs = [("", AppConfig.model_validate(app.args or {}))]
                configs[0][1].check_engine_kwargs()
        except ValidationError as e:
            raise ConfigError(f"{path}:\n" + _format_validation_error(prefix, e)) from None
        except ValueError as e:
            raise ConfigError(f"{path}: {prefix}{e}") from None
        for where, cfg in configs:
            try:
                cfg.admin.check_exposure(schema.http_options.host)
                check_can_start(cfg)
            except ValueError as e:  # ModelError too
                message = in_ray_terms(str(e)) if where else str(e)
                raise ConfigError(f"{path}: {prefix}{where}{message}") from None
