"""adaspec: adaptive speculative decoding for LLM serving on Ray Serve.

This package holds what every part shares and imports without Ray or vLLM: the policy and
telemetry types that cross process boundaries, the embedded model registry, and the CLI.
"""

__version__ = "0.1.0"
