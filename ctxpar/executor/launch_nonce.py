"""The nonce of a torchrun launch: agreed by its ranks, fresh to each of them.

Spawned ranks receive their launch's secret and nonce from rank 0, both drawn
for that launch. torchrun's ranks share a secret that stays the same from
one launch to the next, so a value recorded on the store of an earlier
launch, tag and all, would pass its check in a later one at the same key.
Before anything else, the ranks agree on a nonce that each of them knows to
be fresh, because its own random contribution is in it; every later key lies
under a prefix of that nonce and every tag is keyed with it (auth.py), so a
value of another launch is at another key and fails its check there.

Under fixed key names (the only ones outside the launch's prefix; they say
nothing about the secret)::

    rank 0:  hello   = n0                   n0: 16 random bytes of rank 0's
    rank r:  ready/r = n0' + nr             n0': the hello it read; nr its own
    rank 0:  launch  = n0 + n1 + ... + nP-1 once every ready/r names n0
    (in hex, each value behind its tag)
    nonce = SHA-256(launch)[:16], once rank r finds its own nr in launch

Rank 0 counts a ready/r only if it names this launch's n0, a rank takes
``launch`` only if it names its own nr: a replayed one is ignored, not
obeyed, and the rank waits on for the genuine one, which overwrites it (the
ignored values are named if the agreement times out). A rank that reads an
old hello answers it, and answers again when rank 0's own replaces it. A
value whose tag fails is refused at once (auth.Unauthenticated): written
without the secret, or by a rank given another one, which is the usual
mistake and is named as such.
"""

from __future__ import annotations

import hashlib
import secrets
import time

import torch.distributed as dist

from ctxpar.errors import RankFailure
from ctxpar.executor.startup import POLL_S
from ctxpar.parallel.auth import NONCE_BYTES, Unauthenticated

AGREE_TIMEOUT_S = 120  # the ranks start together (torchrun starts them): this is before any model load


class _Reader:
    """Reads signed values, noting those ignored (of another launch)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.ignored: dict[str, str] = {}

    def get(self, key: str) -> bytes | None:
        """The bytes whose hex ``key`` holds; None while it is absent, forged or not hex."""
        try:
            value = self.store.get(key) if self.store.check([key]) else None
        except Unauthenticated as e:
            raise Unauthenticated(
                f"{e}; or the ranks were given different secrets: every host needs the same CTXPAR_CLUSTER_SECRET"
            ) from None
        try:
            return bytes.fromhex(value.decode()) if value is not None else None
        except ValueError:
            self.stale(key)
            return None

    def stale(self, key: str) -> None:
        self.ignored[key] = "a value of another launch"

    def timeout(self, what: str) -> RankFailure:
        seen = "; ".join(f"{k}: {why}" for k, why in self.ignored.items())
        hint = f" (values ignored: {seen}: recorded in an earlier launch and written again)" if seen else ""
        return RankFailure(f"{what} within {AGREE_TIMEOUT_S} s{hint}")


def agree(store: dist.Store, rank: int, size: int, timeout_s: float = AGREE_TIMEOUT_S) -> bytes:
    """The launch's nonce (NONCE_BYTES), agreed by ranks 0..size-1 under ``store``'s
    keys (a store built on a SignedStore of the cluster secret). RankFailure at the
    deadline; Unauthenticated for a value whose tag fails."""
    reader = _Reader(store)
    deadline = time.monotonic() + timeout_s
    own = secrets.token_bytes(NONCE_BYTES)
    if rank == 0:
        store.set("hello", own.hex())
        nonces = _collect(reader, own, size, deadline)
        store.set("launch", b"".join(nonces).hex())
    else:
        nonces = _await_launch(reader, rank, own, deadline)
    return hashlib.sha256(b"ctxpar launch" + b"".join(nonces)).digest()[:NONCE_BYTES]


def _collect(reader: _Reader, n0: bytes, size: int, deadline: float) -> list[bytes]:
    """Rank 0: every rank's nonce, from the ready/r that name n0."""
    nonces: dict[int, bytes] = {0: n0}
    while len(nonces) < size:
        for r in range(1, size):
            if r in nonces:
                continue
            value = reader.get(f"ready/{r}")
            if value is not None and len(value) == 2 * NONCE_BYTES and value[:NONCE_BYTES] == n0:
                nonces[r] = value[NONCE_BYTES:]
            elif value is not None:
                reader.stale(f"ready/{r}")
        if len(nonces) < size:
            if time.monotonic() > deadline:
                missing = [r for r in range(size) if r not in nonces]
                raise reader.timeout(f"torchrun rank(s) {missing} did not agree on the launch's nonce")
            time.sleep(POLL_S)
    return [nonces[r] for r in range(size)]


def _await_launch(reader: _Reader, rank: int, own: bytes, deadline: float) -> list[bytes]:
    """Rank r: answer rank 0's hello (again when it changes) until ``launch`` names ``own``."""
    answered = None
    while True:
        hello = reader.get("hello")
        if hello is not None and len(hello) == NONCE_BYTES and hello != answered:
            reader.store.set(f"ready/{rank}", (hello + own).hex())
            answered = hello
        launch = reader.get("launch")
        if launch is not None:
            nonces = [launch[i : i + NONCE_BYTES] for i in range(0, len(launch), NONCE_BYTES)]
            if len(launch) % NONCE_BYTES == 0 and rank < len(nonces) and nonces[rank] == own:
                return nonces
            reader.stale("launch")
        if time.monotonic() > deadline:
            raise reader.timeout(f"torchrun rank {rank} did not agree with rank 0 on the launch's nonce")
        time.sleep(POLL_S)
