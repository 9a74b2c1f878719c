"""adaspec: adaptive speculative decoding for LLM serving on Ray Serve.

This package is the bottom layer: what every other part shares, importable without Ray or
vLLM and importing no other adaspec package - the policy and telemetry types that cross
process boundaries, the engine contract, the embedded model registry and the dataset names
and prompt type. Types and contracts only: no pip, no files, no network (`prepare/` gets
models and datasets onto the machine). tests/test_layers.py keeps it that way.
"""

__version__ = "0.1.0"
