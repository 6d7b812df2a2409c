"""The rank processes of the shared-memory channel tests (parallel/test_shm_channel.py).

They are the targets of multiprocessing spawn, so they live in a module that a
spawned process can import by name (helpers.shm_ranks), not in the test module."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ctxpar.parallel.shm_channel import ShmChannel

SLOT = 96  # bytes: most collectives of rank_main need several rounds


def sent(rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """What `rank` sends in collective `step`: computable by every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def shapes(step: int) -> tuple[int, ...]:
    return ((0, 3), (1, 2), (5, 7), (40, 3), (2, 2, 9))[step % 5]


def rank_main(rank: int, size: int, port: int, errors) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
        ch = ShmChannel(store, rank, size, timeout_s=30, slot_bytes=SLOT)
        for step in range(15):
            shape = shapes(step)
            everyone = [sent(k, step, shape) for k in range(size)]
            kind = step % 3
            if kind == 0:
                assert torch.equal(ch.all_gather(everyone[rank]), torch.cat(everyone))
            elif kind == 1:
                got = ch.gather_to_first(everyone[rank])
                assert (got is None) == (rank != 0)
                assert rank != 0 or torch.equal(got, torch.stack(everyone))
            else:  # all_to_all: (P, m, ...) per rank, row k of the result is rank k's row `rank`
                blocks = [sent(k, step, (size, *shape)) for k in range(size)]
                assert torch.equal(ch.all_to_all(blocks[rank]), torch.stack([b[rank] for b in blocks]))
    except BaseException as e:  # reported to the test, which asserts none
        errors.put(f"rank {rank}: {e!r}")
        raise


def peer_main(port: int, behaviour: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    ShmChannel(store, 1, 2, timeout_s=30)
    if behaviour == "silent":
        time.sleep(30)
    os._exit(0)  # "dies": leaves without taking part in the next collective
