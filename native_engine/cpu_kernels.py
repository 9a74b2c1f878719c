"""adaspec's own CPU kernels (native_engine/csrc/*.cpp), built on first use and loaded as torch ops.

- `torch.ops.adaspec.decode_attention`: a decode step's attention over the float32 KV cache
  (native_engine/decode_attention.py);
- `torch.ops.adaspec.panel_matmul`: the float32 matmul of a pass of up to a few hundred
  tokens (a decode step of 1-16 sequences, a verify pass, a short prompt), streaming the
  weight held in panels of 16 output features (`CpuLinear`'s "panels" path,
  native_engine/cpu_linear.py); `panel_matmul_bf16` the same for bfloat16 weights (float32 sums:
  AMX tiles, AVX512-BF16 dot products or AVX2 widening, whichever the CPU has, each function
  built for its own instruction set and chosen at run time).

C++ with AVX2/FMA intrinsics, compiled once per machine with torch's extension builder (about
35 s on 2 cores; cached under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, and
rebuilt when a source or flag changes; scripts/install.sh builds it). Where they cannot run -
a CPU without AVX2 and FMA, no C++ compiler - `load()` says False and the engine keeps
torch's attention and matmuls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Each source stands alone (its few AVX2 helpers included): the builder rebuilds when a
# listed source changes, not when a header one of them includes does.
SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))


@functools.cache
def sources_digest() -> str:
    """A short hash of the kernels' sources: timings measured with other kernels are not reused."""
    return hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES)).hexdigest()[:12]


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the kernels; whether they can run here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        from torch.utils.cpp_extension import load as build

        # OpenMP: the kernels split their work over torch's threads with at::parallel_for,
        # which runs serially in an extension built without it.
        build("adaspec_cpu_kernels", sources=[str(s) for s in SOURCES], is_python_module=False,
              extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - a missing compiler or headers: torch's kernels instead
        logger.warning("adaspec: the CPU kernels did not build (%s: %s); the native engine uses torch's "
                       "attention and matmuls", type(e).__name__, str(e)[:300])
        return False
    for op in ("adaspec::panel_matmul", "adaspec::panel_matmul_bf16"):  # shapes for torch.compile's tracing
        torch.library.register_fake(op)(lambda x, w: x.new_empty(x.shape[0], w.shape[0] * w.shape[2]))
    return True
