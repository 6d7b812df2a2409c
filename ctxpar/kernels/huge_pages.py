"""Memory on 2 MiB pages for what every decode step streams: the weights and the KV cache.

A decode step reads every weight and each row's whole context once. On 4 KiB
pages that is a TLB miss every 4 KiB (SmolLM2's Q4_1 weights and a 2K-token
int8 cache are ~30K pages, ten times what the TLB holds), each a page-table
walk whose entries have themselves been evicted by the step's other bytes.
Transparent huge pages cut the walks 512-fold: SmolLM2's Q4_1 decode steps take
0.94-0.97x the time (docs/benchmarks.md, "Decode steps as one compiled call").
Linux backs memory with them where it was advised ``MADV_HUGEPAGE`` before its
first touch (its default "madvise" mode), so a buffer here is a fresh private
anonymous mapping, advised, then filled.
Where the OS has no huge pages the advice is ignored and the pages are small.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_empty(nbytes: int) -> torch.Tensor:
    """A (nbytes,) uint8 tensor of zeros whose pages the OS is advised to make huge."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    # Private and anonymous: shared anonymous memory is shmem, whose huge pages are off by default.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary: a huge page must be aligned
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes + HUGE_PAGE - start)
    return raw[start : start + nbytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on memory advised huge (see ``huge_empty``)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_empty(nbytes).view(dtype).view(shape)
