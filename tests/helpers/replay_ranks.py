"""The processes of the replay and presence tests (parallel/test_replay_security.py):
torchrun-like ranks agreeing on their launch's nonce, and a rank answering the
start-up handshake. They are targets of multiprocessing spawn, so they live in
a module a spawned process can import by name; each reports through ``results``."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from ctxpar.errors import RankFailure
from ctxpar.executor import launch_nonce, startup
from ctxpar.parallel.auth import Unauthenticated
from ctxpar.parallel.rendezvous_store import open_store
from ctxpar.parallel.signed_store import SignedStore

SECRET = b"a torchrun job's secret, the same in every launch"
BOOTSTRAP = "ctxpar/torchrun/0/"  # where the executor's first launch agrees on its nonce
PREFIX = "victim/"


_KEEP: list[SignedStore] = []  # a Python store lives only as long as its object (signed_store.py)


def signed(port: int, prefix: str, secret: bytes = SECRET) -> dist.Store:
    """A rank's view of the store: its keys under ``prefix``, every value tagged with ``secret``."""
    store = SignedStore(open_store("127.0.0.1", port, is_master=False), secret)
    _KEEP.append(store)
    return dist.PrefixStore(prefix, store)


def agreeing_rank(port: int, rank: int, size: int, timeout_s: float, results: Any, secret: bytes = SECRET) -> None:
    """A torchrun rank agreeing on its launch's nonce, as MultiRankExecutor does first."""
    try:
        nonce = launch_nonce.agree(signed(port, BOOTSTRAP, secret), rank, size, timeout_s)
        results.put((port, rank, "agreed", nonce.hex()))
    except (RankFailure, Unauthenticated) as e:
        results.put((port, rank, "failed", str(e)))


def ready_rank(port: int, go: Any, results: Any) -> None:
    """Rank 1 of a launch that waits for ``go`` (its model still loading), then answers the
    start-up handshake as every worker does (a signed ready/1) and waits for the verdict."""
    go.wait(120)
    try:
        startup.follow(signed(port, PREFIX), 1, time.monotonic() + 60)
        results.put("joined")
    except RankFailure as e:
        results.put(f"failed: {e}")
