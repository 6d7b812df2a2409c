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

A model's weights are written straight into such memory as they are read
(``HugeArena``), so that they are not laid out once and then copied there:
``on_huge_pages`` tells a weight that is there already from one to move.

A KV cache's pages are made ahead of the steps that write them
(``fault_in_background``): a page's first touch clears it, which on a VM also
makes the host back it, and a prefill that wrote the first rows of fresh pages
spent that in its step while its other thread waited.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each of a HugeArena's tensors starts on a cache line
ARENA_CHUNK = 256 << 20  # bytes a HugeArena maps at a time (more for a larger tensor)
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14+: make pages writable now, their bytes left as they are

# The first bytes of huge_empty's mappings that are still alive: a tensor's storage
# starts there exactly when it is (a view of) one of them.
_LIVE: set[int] = set()


def huge_empty(nbytes: int) -> torch.Tensor:
    """A (nbytes,) uint8 tensor of zeros whose pages the OS is advised to make huge."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    # Private and anonymous: shared anonymous memory is shmem, whose huge pages are off by default.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # the first 2 MiB boundary: a huge page must be aligned
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes + HUGE_PAGE - start)
    _LIVE.add(raw.data_ptr())
    weakref.finalize(region, _LIVE.discard, raw.data_ptr())  # unmapped once its last tensor goes
    return raw[start : start + nbytes]


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in memory of ``huge_empty``'s advised huge (its mapping is still alive)."""
    return t.untyped_storage().data_ptr() in _LIVE


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on memory advised huge (see ``huge_empty``)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return huge_empty(nbytes).view(dtype).view(shape)


class HugeArena:
    """Tensors carved one after another out of memory advised huge, each on a cache
    line, for weights written where they will stay while the total is not yet known:
    it maps ``ARENA_CHUNK`` bytes at a time (or a larger tensor's own), and the pages
    of a mapping's unused end are never touched, so never made."""

    def __init__(self) -> None:
        self._chunk = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of zeros of ``shape`` and ``dtype`` in the arena, to be written."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // ALIGN) * ALIGN
        if start + nbytes > self._chunk.numel():
            self._chunk, start = huge_empty(max(ARENA_CHUNK, nbytes)), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes].view(dtype).view(shape)


def fault_in_background(t: torch.Tensor, stripes: int) -> threading.Thread | None:
    """Make the pages of ``t`` (of ``huge_empty``'s memory) now, on a thread that runs only
    on otherwise idle CPUs (SCHED_IDLE), so the steps that first write them need not.

    ``t`` is cut into ``stripes`` equal parts along its first dimension (a KV cache's
    layers) and one huge page of each part is made in turn, from the parts' starts: the
    order in which the block manager hands out blocks (lowest id first) and a step writes
    a block's rows in every layer. The advice (MADV_POPULATE_WRITE) leaves bytes as they
    are, so steps may write the cache meanwhile. The thread holds ``t`` only while the
    kernel works on one page, so a closed engine's cache is freed at once, and it stops
    once ``t`` is gone or where the OS lacks the advice.
    Returns the thread (None: not memory of ``huge_empty``, nothing to do)."""
    if not on_huge_pages(t) or t.shape[0] % stripes:
        return None
    ref = weakref.ref(t)
    start, part = t.data_ptr(), t.numel() * t.element_size() // stripes
    thread = threading.Thread(target=_fault_in, args=(ref, start, part, stripes), name="kv-fault-in", daemon=True)
    thread.start()
    return thread


def _fault_in(ref: weakref.ref[torch.Tensor], start: int, part: int, stripes: int) -> None:
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: the GIL is released
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread alone
    except (AttributeError, OSError):
        return  # at normal priority it would take CPU from the steps: they make the pages as before
    for offset in range(0, part, HUGE_PAGE):
        for stripe in range(stripes):
            t = ref()  # alive for the call: its mapping cannot go while the kernel works on it
            if t is None:
                return
            lo = start + stripe * part + offset
            hi = start + stripe * part + min(offset + HUGE_PAGE, part)
            lo, hi = lo - lo % PAGE, -(-hi // PAGE) * PAGE  # within the mapping: it starts on a huge page
            failed = madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0
            del t
            if failed:
                return  # an OS without the advice: the steps make the pages as before
