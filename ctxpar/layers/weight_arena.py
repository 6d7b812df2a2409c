"""A model's packed weights moved, back to back, into one buffer of bytes.

Two buffers hold them this way: pages on 2 MiB boundaries that the OS makes
huge (every rank on the CPU, ``place_on_huge_pages``), and one segment of
shared pages per host that every PCP rank maps (executor/shared_weights.py).
Each weight starts on a cache line; the order is ``shared_tensors``', the same
on every rank, so every rank lays out the same bytes at the same offsets.
Weights a loader wrote on huge pages already (a GGUF's blocks, models/gguf.py)
stay where they are.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from ctxpar.kernels.huge_pages import ALIGN, huge_empty, on_huge_pages
from ctxpar.layers.linear import shared_tensors

TRIM_BYTES = 256 << 20  # weights moved between returns of their old copies' pages to the OS


@dataclass(frozen=True)
class WeightArena:
    """Where each packed weight goes in the buffer. It holds no tensor itself: a
    weight's own memory is freed as soon as its holder points into the buffer."""

    holders: list[tuple[object, str]]  # (holder, attribute) of each weight tensor
    offsets: list[int]  # bytes into the buffer
    total: int  # bytes of the buffer (0: the model has no packed weights)

    @classmethod
    def of(cls, model: nn.Module) -> WeightArena:
        """Every packed weight of ``model``."""
        return cls.of_holders(shared_tensors(model))

    @classmethod
    def of_holders(cls, holders: list[tuple[object, str]]) -> WeightArena:
        """The weights ``holders`` names, in that order."""
        offsets, total = [], 0
        for h, a in holders:
            w = getattr(h, a)
            offsets.append(total)
            total += -(-w.numel() * w.element_size() // ALIGN) * ALIGN
        return cls(holders, offsets, total)

    def fill(self, buffer: torch.Tensor) -> None:
        """Copy the weights into ``buffer`` ((total,) uint8)."""
        for (holder, attr), off in zip(self.holders, self.offsets):
            w = getattr(holder, attr)
            buffer[off : off + w.numel() * w.element_size()].copy_(w.reshape(-1).view(torch.uint8))

    def point_at(self, buffer: torch.Tensor, fill: bool = False) -> None:
        """Make every weight a view of ``buffer`` (copying it there first with ``fill``),
        one weight at a time: the model never holds two copies of all its weights."""
        trimmed = 0
        for (holder, attr), off in zip(self.holders, self.offsets):
            w = getattr(holder, attr)
            view = buffer[off : off + w.numel() * w.element_size()]
            if fill:
                view.copy_(w.reshape(-1).view(torch.uint8))
            setattr(holder, attr, view.view(w.dtype).view(w.shape))
            del w
            if off - trimmed >= TRIM_BYTES:
                release_freed_memory()
                trimmed = off
        release_freed_memory()


def place_on_huge_pages(model: nn.Module) -> None:
    """Move ``model``'s packed weights (on the CPU) into one buffer of huge pages, but for
    those on huge pages already."""
    arena = WeightArena.of_holders([h for h in shared_tensors(model) if not on_huge_pages(getattr(*h))])
    if arena.total == 0 or getattr(*arena.holders[0]).device.type != "cpu":
        return
    arena.point_at(huge_empty(arena.total), fill=True)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim): the weights'
    first copies below malloc's mmap threshold (32 MiB) were freed into the heap,
    which glibc keeps, so without it the process would stay as large as two copies."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return
    libc.malloc_trim(0)
