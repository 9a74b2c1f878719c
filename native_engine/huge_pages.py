"""Weights on 2 MB pages (Linux transparent huge pages), for the copies a decode step streams.

Why: a batch-1 decode step reads every weight once, and on 4 KB pages a pass over SmolLM2's
538 MB touches 131,000 pages, a TLB miss and a page walk every 4 KB on top of the memory
stream. Linux backs a region with 2 MB pages only where asked (`madvise` mode, the default of
many distributions, and of this project's machines), and neither torch nor glibc asks. On 2
AMD EPYC (Zen 2) cores the panel kernel's pass over SmolLM2's weights took 7-12% less time on
2 MB pages (20.5 / 20.7 against 23.4 / 22.4 ms), a decode step 1-6% less (docs/native-engine.md,
"The panel matmul": huge pages). Elsewhere (another OS, huge pages off) the advice is refused
and the memory is ordinary: nothing else changes.
"""

from __future__ import annotations

import mmap

import torch

PAGE = 2 << 20  # bytes in a huge page on x86-64 and arm64 Linux


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements starting on a 2 MB boundary, its
    pages advised huge before anything touches them (the first write then faults in 2 MB pages).
    A fresh anonymous mapping, not the allocator's: in a process that has run a while, glibc
    hands out heap memory that was written before, whose 4 KB pages the advice does not
    replace (seen in the test suite's process). Up to 2 MB of address space more than it needs,
    and at most one partly used huge page."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = -(-nbytes // PAGE) * PAGE
    # Private: a shared anonymous mapping is shmem, which huge pages in `madvise` mode skip.
    region = mmap.mmap(-1, span + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned
    start = -_address(region) % PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the memory stays ordinary
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, span)
        except OSError:
            pass  # huge pages off: ordinary pages
    # The tensor holds the mapping alive (torch.frombuffer keeps a reference to it).
    return torch.frombuffer(region, dtype=torch.uint8, count=span, offset=start).view(dtype)[:numel]


def _address(region: mmap.mmap) -> int:
    """Where a mapping starts in memory."""
    return torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()


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
