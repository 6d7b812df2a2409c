"""Torchrun's ranks tag their bulk collectives (issue 39): two real gloo ranks of a
PCPGroup formed as under torchrun with a cluster secret, the shared-memory
channel off (as between hosts).

- with genuine tags every collective (all-gather, all-to-all, gather to rank 0,
  broadcast) returns exactly the bytes the ranks contributed; spawned ranks
  get the same bytes, untagged;
- a contribution altered after it was tagged (a man in the middle), or tagged
  with another secret, makes the receiver raise Unauthenticated naming the
  rank and the collective, and the altered data is never returned (a refused
  broadcast leaves the receiver's tensor as it was).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ctxpar.parallel.rendezvous_store import host_store
from helpers.sealed_ranks import KINDS, SECRET, contribution, inputs, rank_main

pytestmark = pytest.mark.multiprocess  # every test here starts rank processes

DTYPES = (torch.bfloat16, torch.float32, torch.int64)


def _run_ranks(spawned: bool, secrets: tuple[bytes, bytes], tamper: int | None, kinds: tuple[str, ...]) -> dict:
    """Start ranks 0 and 1 (rank ``tamper`` altering its contributions after tagging); their reports by rank."""
    ctx = mp.get_context("spawn")
    store = host_store("127.0.0.1", 0)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, store.port, spawned, secrets[r], tamper == r, kinds, results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    reports: dict = {}
    try:
        for _ in range(2):
            rank, outcome, what = results.get(timeout=120)
            reports[rank] = (outcome, what)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return reports


def _bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def _expected(rank: int) -> list[tuple[str, bytes | None]]:
    """What rank ``rank`` must receive from the collectives of KINDS."""
    want: list[tuple[str, bytes | None]] = []
    for kind in KINDS:
        for dtype in DTYPES:
            mine = [contribution(r, dtype) for r in range(2)]
            if kind == "all_gather":
                want.append((kind, _bytes(torch.cat(mine))))
            elif kind == "all_to_all":
                want.append((kind, _bytes(torch.stack([inputs(r, kind, dtype)[rank] for r in range(2)]))))
            elif kind == "gather_to_first":
                want.append((kind, _bytes(torch.stack(mine)) if rank == 0 else None))
            else:
                want.append((kind, _bytes(mine[0])))
    return want


@pytest.mark.parametrize("spawned", [False, True], ids=["torchrun", "spawned"])
def test_tagged_collectives_return_the_exact_bytes(spawned):
    reports = _run_ranks(spawned, (SECRET, SECRET), None, KINDS)
    for rank in range(2):
        outcome, got = reports[rank]
        assert outcome == "received", got
        assert got[0] == ("sealed", b"0" if spawned else b"1")  # spawned ranks: untagged, no cost
        assert got[1:] == _expected(rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["altered", "other-secret"])
def test_a_forged_contribution_is_refused_unused(kind, how):
    """The sender is rank 1, the receiver rank 0 (for a broadcast: rank 0 sends, rank 1 receives)."""
    sender, receiver = (0, 1) if kind == "broadcast" else (1, 0)
    secrets = (SECRET, SECRET)
    if how == "other-secret":
        secrets = tuple(b"a guess at the secret" if r == sender else SECRET for r in range(2))  # type: ignore[assignment]
    reports = _run_ranks(False, secrets, sender if how == "altered" else None, (kind,))
    outcome, (text, held) = reports[receiver]
    assert outcome == "refused", text
    assert f"PCP {kind} message 0 from rank {sender} failed authentication at rank {receiver}" in text
    # Nothing altered came back: the refusal is raised before a result exists, and
    # a refused broadcast leaves the receiver's own tensor (the first: bfloat16) as it was.
    assert held == _bytes(inputs(receiver, kind, torch.bfloat16))
