"""Weights on 2 MB pages (Linux transparent huge pages), for the copies a decode step streams.

Why: a batch-1 decode step reads every weight once, and on 4 KB pages a pass over SmolLM2's
538 MB touches 131,000 pages, a TLB miss and a page walk every 4 KB on top of the memory
stream. Linux backs a region with 2 MB pages only where asked (`madvise` mode, the default of
many distributions, and of this project's machines), and neither torch nor glibc asks. On 2
AMD EPYC (Zen 2) cores the panel kernel's pass over SmolLM2's weights took 8-12% less time on
2 MB pages (docs/native-engine.md, "The panel matmul": huge pages). Elsewhere (another OS, huge pages off) the
advice is refused and the memory is ordinary: nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

PAGE = 2 << 20  # bytes in a huge page on x86-64 and arm64 Linux
MADV_HUGEPAGE = 14  # <sys/mman.h>


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


def advise(address: int, nbytes: int) -> bool:
    """Ask Linux to back [address, address + nbytes) with huge pages (both multiples of PAGE);
    whether it agreed."""
    fn = _madvise()
    return fn is not None and fn(address, nbytes, MADV_HUGEPAGE) == 0


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements starting on a 2 MB boundary, its
    pages advised huge before anything touches them (the first write then faults in 2 MB pages).
    Up to 2 MB of address space more than it needs, and at most one partly used huge page."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = -(-nbytes // PAGE) * PAGE
    raw = torch.empty(span + PAGE, dtype=torch.uint8)  # large enough that the allocator maps fresh pages
    start = -raw.data_ptr() % PAGE
    region = raw[start:start + span]
    advise(region.data_ptr(), span)
    return region.view(dtype)[:numel]


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous, one dtype), one after another in one region on huge
    pages, in the given order: a decode step that streams them in that order reads one
    contiguous span. The copies keep the region alive."""
    arena = empty(sum(t.numel() for t in tensors), tensors[0].dtype)
    copies, offset = [], 0
    for t in tensors:
        copy = arena[offset:offset + t.numel()].view(t.shape)
        copy.copy_(t)
        copies.append(copy)
        offset += t.numel()
    return copies
