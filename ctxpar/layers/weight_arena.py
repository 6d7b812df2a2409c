"""A model's packed weights moved, back to back, into one buffer of bytes.

Two buffers hold them this way: pages on 2 MiB boundaries that the OS makes
huge (every rank on the CPU, ``place_on_huge_pages``), and one segment of
shared pages per host that every PCP rank maps (executor/shared_weights.py).
Each weight starts on a cache line; the order is ``shared_tensors``', the same
on every rank, so every rank lays out the same bytes at the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ctxpar.kernels.huge_pages import huge_empty
from ctxpar.layers.linear import shared_tensors

ALIGN = 64  # bytes: each weight starts on a cache line


@dataclass(frozen=True)
class WeightArena:
    holders: list[tuple[object, str]]  # (holder, attribute) of each weight tensor
    weights: list[torch.Tensor]
    offsets: list[int]  # bytes into the buffer
    total: int  # bytes of the buffer (0: the model has no packed weights)

    @classmethod
    def of(cls, model: nn.Module) -> WeightArena:
        holders = shared_tensors(model)
        weights = [getattr(h, a) for h, a in holders]
        offsets, total = [], 0
        for w in weights:
            offsets.append(total)
            total += -(-w.numel() * w.element_size() // ALIGN) * ALIGN
        return cls(holders, weights, offsets, total)

    def fill(self, buffer: torch.Tensor) -> None:
        """Copy the weights into ``buffer`` ((total,) uint8)."""
        for w, off in zip(self.weights, self.offsets):
            buffer[off : off + w.numel() * w.element_size()].copy_(w.reshape(-1).view(torch.uint8))

    def point_at(self, buffer: torch.Tensor) -> None:
        """Make every weight a view of ``buffer`` (filled), freeing its own copy."""
        for (holder, attr), w, off in zip(self.holders, self.weights, self.offsets):
            setattr(holder, attr, buffer[off : off + w.numel() * w.element_size()].view(w.dtype).view(w.shape))


def place_on_huge_pages(model: nn.Module) -> None:
    """Move ``model``'s packed weights (on the CPU) into one buffer of huge pages."""
    arena = WeightArena.of(model)
    if arena.total == 0 or arena.weights[0].device.type != "cpu":
        return
    buffer = huge_empty(arena.total)
    arena.fill(buffer)
    arena.point_at(buffer)
