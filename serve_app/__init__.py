"""The adaspec Ray Serve application: `serve run configs/app.yaml` imports `serve_app:build_app`.

Modules: `config` (the app config schema), `builder` (config -> Serve application),
`ingress` (OpenAI + admin HTTP routes), `replica` (the replica deployment),
`vllm_engine` / `vllm_scheduler` (the live policy and telemetry inside vLLM),
`native_adapter` / `native_loop` / `native_openai` (the native tree engine served).
"""

from typing import Any


def build_app(args: dict[str, Any] | None = None):
    # Imported lazily: vLLM's engine-core process imports serve_app.vllm_scheduler and
    # should not pay for the Serve application modules.
    from serve_app.builder import build_app as _build_app

    return _build_app(args)
