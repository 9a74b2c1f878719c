"""Compiled decode (config `compile_decode: true`): a model's one-token passes and batch-1
verify passes run as torch.compile graphs (docs/native-engine.md, "Compiled decode").

`compile_decode` sets `Transformer.compiled_decode`, which `Transformer.forward` then calls
for the passes it takes (native_engine/model.py, COMPILED_TOKENS_AT_BATCH_1); the engine
warms the graphs up (`NativeEngine.compile_decode`).
"""

from __future__ import annotations

import time
import types
from typing import Callable

import torch

from native_engine import cpu_linear
from native_engine.cpu_linear import CpuLinear, panel_rows
from native_engine.model import Transformer


def compile_decode(model: Transformer, warm_up: Callable[[], None], autotune: bool = False,
                   cpp_wrapper: bool = True) -> float:
    """Compile `model.decoder` with torch.compile (inductor, weights frozen into the graph) for
    passes of one token per row (decode steps without drafts: every step of `off`, any
    batch size) and, at batch 1, of up to COMPILED_TOKENS_AT_BATCH_1 tokens (a chain's or
    a tree's verify pass); other passes (wider batches' verify passes, long prefills)
    stay eager. `warm_up` runs such passes, one row, several rows and one row of several
    tokens, so the compiles happen now: three graphs, the batch size symbolic in the
    second and the token count in the third. Key lengths, masks and cache rows never
    recompile: attention is an opaque op reading them from the forward in progress.
    Returns the seconds spent (about a minute on 2 CPU cores; inductor caches its kernels
    on disk, so a restart on the same machine is faster).

    `autotune`: inductor also times its own C++ GEMM templates against the library matmul
    for every weight shape and keeps the faster (max_autotune with the CPP backend): about
    2.5 minutes on 2 cores instead of one; a bf16 one-token step of SmolLM2 took 15.0 ms
    against 19.3 ms (oneDNN's bf16 matmul streams at about 21 GB/s), fp32 22.9 against
    23.3-24 (docs/native-engine.md).

    `cpp_wrapper`: inductor's C++ wrapper runs each graph (below); False keeps its Python
    wrapper, whose library calls a profiler sees one by one (the C++ one calls them unseen).

    Eager decoding pays a dispatch for each of some 180 aten calls per layer (most of them
    views); compiled, the elementwise ones run as a few fused C++ loops (docs/native-engine.md, "Compiled decode").

    The matmuls: left to itself, inductor prepacks a float32 weight for MKL's packed sgemm
    in a graph of a fixed row count (the batch-1 one) and for oneDNN's matmul where the rows
    are symbolic. Where the measured route (`linear_choice`) put one-token passes on
    oneDNN's prepacked matmul, the fixed-row graph calls that instead
    (`compiled_matmul_path`): on an AMD EPYC (Zen 2) MKL streamed the weights 10-50% slower
    at one row, and the batch-1 step was 1.18-1.23x faster on oneDNN (docs/native-engine.md)."""
    start = time.perf_counter()
    for m in model.modules():
        if isinstance(m, CpuLinear):
            m.graph_path = cpu_linear.compiled_matmul_path(m, autotune)  # looked up here: an A/B may swap it
            m.graph_rows = panel_rows(m.route)
    # Dynamo keeps its graphs per code object, and with the module guards skipped (they would
    # be checked on every call) it would hand this model a graph compiled for another model
    # of the same shapes in the process, with that model's frozen weights: each model
    # compiles a code object of its own.
    code = Transformer.decoder.__code__.replace(co_name=f"decoder_{id(model):x}")
    decoder = types.MethodType(types.FunctionType(code, Transformer.decoder.__globals__,
                                                  argdefs=Transformer.decoder.__defaults__), model)
    model.compiled_decode = torch.compile(
        decoder, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    # Frozen weights become constants inductor lays out for its matmuls where `graph_path`
    # leaves them to it (torch.compile's options={"freezing": True} did not reach the
    # weight-packing pass here). The C++ wrapper calls the graph's ~250 kernels and library
    # ops without a Python line each: 0.99-1.15x per decode step at batch 1-16 on the AMD
    # EPYC, 8 of 9 interleaved rounds faster, for about 35 s more compile time
    # (docs/native-engine.md).
    # Reduced precision: inductor rounds where eager rounds (a fused kernel otherwise keeps
    # an intermediate in float32 that one graph materialises in bf16 and another does not),
    # so the one-token graph and the verify graph give a token the same bits: without it,
    # compiled bf16 chain4 left compiled `off`'s tokens at tokens 29 and 35 of two of four
    # HumanEval prompts (2026-12-05; docs/native-engine.md, "bfloat16 on a CPU").
    options = {"freezing": True, "cpp_wrapper": cpp_wrapper,
               "emulate_precision_casts": model.lm_head.weight.dtype != torch.float32}
    if autotune:
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    with torch.no_grad(), torch._inductor.config.patch(**options):
        warm_up()
    return time.perf_counter() - start


def compiled_row_splits(model: Transformer) -> list[int]:
    """Row counts where the compiled passes change matmul path (see CpuLinear.forward): a
    pass of that many rows or tokens compiles a graph of its own, so the warm-up runs one."""
    return sorted({m.graph_rows + 1 for m in model.modules()
                   if isinstance(m, CpuLinear) and m.graph_path == "panels" and m.graph_rows > 1})
