"""adaspec's native tree engine: a Llama-family decoder, KV cache, token trees, drafters,
verification and a continuously batching engine, in plain PyTorch.

Importable without Ray or vLLM (torch, safetensors and a tokenizer only). The engine is
driven step by step (`NativeEngine.add_request`, `step`, `abort`, `drain_steps`) so a serving
wrapper can run it in a loop.
"""
