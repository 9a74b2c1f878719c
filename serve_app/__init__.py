"""The adaspec Ray Serve application: `serve run configs/app.yaml` imports `serve_app:build_app`;
a config written for Ray Serve LLM (`ray.serve.llm:build_openai_app`) runs with
`import_path: serve_app:build_openai_app` (docs/from-ray-serve-llm.md).

Modules: `config` (the app config schema), `builder` (config -> Serve application),
`ingress` (OpenAI + admin HTTP routes), `replica` (the replica deployment),
`vllm_engine` / `vllm_scheduler` (the live policy and telemetry inside vLLM),
`native_adapter` / `native_loop` / `native_openai` (the native tree engine served),
`ray_serving_args` (Ray Serve LLM's args read as adaspec's config).
"""

from typing import Any


def build_app(args: dict[str, Any] | None = None):
    # Imported lazily: vLLM's engine-core process imports serve_app.vllm_scheduler and
    # should not pay for the Serve application modules.
    from serve_app.builder import build_app as _build_app

    return _build_app(args)


def build_openai_app(args: dict[str, Any]):
    from serve_app.builder import build_openai_app as _build_openai_app

    return _build_openai_app(args)
