"""The float32 decode-attention kernel (csrc/decode_attention.cpp): built here, used where it can run.

A decode step's attention (one new token per sequence over its KV cache) is the one part of
a batch-16 step that grows with the cache and not with the weights. torch's CPU attention
runs it as two small GEMMs and a masked softmax per (sequence, KV head); the kernel reads each
sequence's keys and values once, up to its own length instead of the batch's longest, with
the query heads that share a KV head side by side (docs/native-engine.md, "Decode attention").

It is C++ with AVX2/FMA intrinsics, compiled on first use with torch's extension builder
(about 30 s; cached under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, and
rebuilt when the source or flags change). Where it cannot run, `kernel()` returns None and
attention stays torch's: a CPU without AVX2 and FMA, no C++ compiler, head dims that are not
a multiple of 16, another dtype.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"


@functools.cache
def kernel():
    """torch.ops.adaspec.decode_attention once built and loaded, or None where it cannot run here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # OpenMP: the kernel splits its (sequence, KV head) pairs over torch's threads with
        # at::parallel_for, which runs serially in an extension built without it.
        load("adaspec_decode_attention", sources=[str(SOURCE)], is_python_module=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
        return torch.ops.adaspec.decode_attention
    except Exception as e:  # noqa: BLE001 - a missing compiler or headers: attention stays torch's
        logger.warning("adaspec: the decode-attention kernel did not build (%s: %s); decode steps use "
                       "torch's attention", type(e).__name__, str(e)[:300])
        return None


def supports(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the kernel takes a model of this head size, dtype and device."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
                     ) -> torch.Tensor:
    """Attention of q [B, H, Dh] (one token per sequence) over keys/values [B, Hkv, S, Dh]
    (views of the cache, Dh contiguous), sequence b reading its first lengths[b] keys
    (int64 [B], 1..S). Query head i reads KV head i // (H / Hkv), as in grouped-query
    attention. Returns [B, H * Dh]; call only where `kernel()` is not None."""
    B, H, Dh = q.shape
    Hkv = keys.shape[1]
    out = kernel()(q.reshape(B, Hkv, H // Hkv, Dh).contiguous(), keys, values, lengths, Dh ** -0.5)
    return out.view(B, H * Dh)
