"""The ranks of the tagged-collectives tests (parallel/test_sealed_collectives.py):
two real gloo ranks of a PCPGroup formed as under torchrun (a shared cluster
secret, not spawned by rank 0) or as spawned ranks, with the shared-memory
channel off (as across hosts). They are targets of multiprocessing spawn, so
they live in a module a spawned process can import by name.

Each rank reports through ``results`` (rank, outcome, what): ("received", the
results of its collectives as bytes) or ("refused", the error's text)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ctxpar.parallel.auth import Unauthenticated
from ctxpar.parallel.comm import Launch, PCPGroup
from ctxpar.parallel.rendezvous_store import open_store

SECRET = b"the cluster secret of the hosts of this job"
KINDS = ("all_gather", "all_to_all", "gather_to_first", "broadcast")


def contribution(rank: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rank ``rank``'s (2, 3, 5) tensor: distinct per rank, not all zeros."""
    g = torch.Generator().manual_seed(rank + 1)
    return (torch.randn(2, 3, 5, generator=g) * 100).to(dtype)


def inputs(rank: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``rank`` contributes to a collective of ``kind``: all_to_all's row j goes to rank j."""
    if kind == "all_to_all":
        return torch.stack([contribution(rank * 2 + j, dtype)[0] for j in range(2)])
    return contribution(rank, dtype)


def run(group: PCPGroup, kind: str, x: torch.Tensor) -> torch.Tensor | None:
    """One data collective of ``kind`` on x; the result (broadcast_: x, written in place)."""
    if kind == "all_gather":
        return group.all_gather(x)
    if kind == "all_to_all":
        return group.all_to_all(x)
    if kind == "gather_to_first":
        return group.gather_to_first(x)
    group.broadcast_(x)
    return x


def _report(results: Any, outcome: tuple[int, str, Any]) -> None:
    results.put(outcome)
    results.close()
    results.join_thread()
    os._exit(0)  # leave the (possibly broken) group without waiting for its peer


def rank_main(
    rank: int, port: int, spawned: bool, secret: bytes, tamper: bool, kinds: tuple[str, ...], results: Any
) -> None:
    """Rank ``rank`` of a group of two: makes the collectives ``kinds`` (each on
    bfloat16, float32 and int64 contributions). tamper: this rank flips a byte of
    each contribution after tagging it (as a man in the middle would on the wire).
    A refusing rank reports its error and what its x holds then."""
    os.environ["CTXPAR_SHM"] = "0"  # gloo, as between hosts
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the test's two ranks are on this host
    os.environ["CTXPAR_COLLECTIVE_TIMEOUT_S"] = "20"
    torch.set_num_threads(1)
    store = open_store("127.0.0.1", port, is_master=False)
    group = PCPGroup(rank, 2, torch.device("cpu"), store, Launch(secret, spawned=spawned))
    if tamper:
        assert group.sealed is not None
        seal = group.sealed._sealed

        def tampered(kind: str, payload: torch.Tensor, receiver: int, into: torch.Tensor) -> None:
            seal(kind, payload, receiver, into)
            into[0] ^= 1  # after the tag: the bytes no longer match it

        group.sealed._sealed = tampered  # type: ignore[method-assign]
    got: list[tuple[str, bytes | None]] = [("sealed", b"1" if group.sealed is not None else b"0")]
    try:
        for kind in kinds:
            for dtype in (torch.bfloat16, torch.float32, torch.int64):
                x = inputs(rank, kind, dtype)
                out = run(group, kind, x)
                got.append((kind, None if out is None else out.contiguous().view(torch.uint8).numpy().tobytes()))
    except Unauthenticated as e:
        # What the rank holds after a refused broadcast: its own x, unchanged.
        _report(results, (rank, "refused", (str(e), x.contiguous().view(torch.uint8).numpy().tobytes())))
    except Exception as e:  # the peer refused and left: this rank's next collective fails
        _report(results, (rank, "failed", (str(e), b"")))
    _report(results, (rank, "received", got))
