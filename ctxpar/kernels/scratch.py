"""Large kernel outputs in buffers that are handed out again once nothing holds them.

PyTorch's CPU allocator caches nothing, and glibc maps every allocation past its
largest mmap threshold (32 MiB) afresh: each page of such an output is faulted and
zeroed by the kernel when the product first writes it, and unmapped when the tensor
dies. A prefill's widest products pass that size every layer (Llama-3.2-1B's gate|up
at 512 rows is 32 MiB), and the faults cost about a fifth of that product's time.

``empty`` gives a tensor of at least ``LARGE`` bytes from one of the calling thread's
buffers that no tensor shares any more: every tensor and view of a buffer's memory
holds a use of its storage, so a storage used by the pool's own reference alone is
free. A buffer in use is never handed out; a request that no free buffer holds gets
memory of its own, kept for later while the thread keeps under ``KEPT`` buffers and
``KEPT_BYTES`` (a rare huge output, prompt logprobs' logits, is not held on to). The
contents are whatever was there, as torch.empty's are: the kernels write every element
of their outputs.
"""

from __future__ import annotations

import math
import threading

import torch

LARGE = 32 << 20  # bytes: glibc's largest mmap threshold on 64-bit; smaller blocks come back from its heap
KEPT = 4  # buffers kept per thread: a layer's products hold at most two large outputs at once
KEPT_BYTES = 512 << 20  # and their bytes: an 8B layer's gate|up and SiLU·up at 2048 rows are 352 MiB

_local = threading.local()


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` (as torch.empty): from a free kept buffer when
    it is ``LARGE`` bytes or more."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < LARGE:
        return torch.empty(shape, dtype=dtype)
    kept: list[torch.Tensor] = _local.__dict__.setdefault("kept", [])  # flat uint8 buffers
    free = [i for i, buf in enumerate(kept) if _free(buf)]
    if fits := [i for i in free if kept[i].numel() >= nbytes]:
        return kept[min(fits, key=lambda i: kept[i].numel())][:nbytes].view(dtype).view(shape)
    if free:  # a free buffer too small: given up for this larger one
        del kept[free[0]]
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if len(kept) < KEPT and sum(b.numel() for b in kept) + nbytes <= KEPT_BYTES:
        kept.append(buf)
    return buf.view(dtype).view(shape)


def _free(buf: torch.Tensor) -> bool:
    """Whether only the pool holds buf's memory: its storage's uses are the pool's tensor
    and the storage object made to ask (every other tensor or view of it adds one)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2
