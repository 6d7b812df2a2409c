"""The data group's collectives over gloo with every contribution tagged (torchrun).

Ranks that torchrun starts may be on several hosts, so their KV all-gathers,
hidden-state gathers, DCP partials and KV broadcasts cross a network. Under a
cluster secret (cluster_secret.py) each rank appends to what it sends an
HMAC-SHA256 tag over (the collective's kind, the group's message number, the
sender's rank, the receiver's rank for a message meant for one rank, the
bytes), with a key of its own derived from the launch secret, the launch's
nonce and the group's generation; every receiver
checks every other rank's tag with ``hmac.compare_digest`` before the data is
used, and raises ``auth.Unauthenticated`` naming the rank and the collective on
a mismatch (the result, and a broadcast's destination, are then never written).
The message number counts the group's data collectives, which every rank makes
in the same order, so a recorded contribution cannot be replayed elsewhere in
the stream; the receiver's rank keeps a row of an all-to-all from being
redirected to another rank.

Cost: HMAC-SHA256 runs at C speed (OpenSSL, SHA-NI) over a memoryview of the
tensor's bytes (no copy): measured on this development host's CPU (a Xeon, 2
cores, one thread, under load) at ~0.6 ms per MB (~1.6 GB/s) for messages up
to a few MB, ~0.9 ms per MB at 64 MB. A rank tags its own contribution once and
checks the P - 1 it receives (all-gather: P x 0.6 ms per MB of each rank's
contribution; gather to rank 0: the same on rank 0, one tag elsewhere). That is
comparable to what a 10 Gbit/s link takes to carry the bytes (~0.8 ms per MB),
so across hosts it can up to double a bulk collective's time; the 32-byte tag
per message is nothing on the wire. The tag also costs one copy of the contribution into a
send buffer (its bytes, then the tag) and one of the received bytes out of the
tagged receive buffer: ~0.03 to 0.15 ms per MB each.

Spawned ranks (one host: loopback gloo or shared pages), torchrun ranks that
find they are all on one host (shared pages), and NCCL (GPUs) are not tagged:
comm.PCPGroup uses this only for gloo under torchrun with a cluster secret.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import torch
import torch.distributed as dist

from ctxpar.parallel.auth import TAG_BYTES, Unauthenticated, derive_key

# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

EVERY_RANK = -1  # the receiver field of a message every rank receives


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """x's bytes as a flat uint8 tensor: a view when x is contiguous (one copy else)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


class SealedCollectives:
    """The data group's all-gather, all-to-all, gather to rank 0 and broadcast from
    rank 0, each rank's contribution tagged with the launch secret and checked by
    every rank that receives it. Every rank of the group must make the same
    collectives in the same order (as with any collective): each counts them."""

    def __init__(self, secret: bytes, ctx: bytes, rank: int, size: int, group: dist.ProcessGroup) -> None:
        """ctx: the launch's nonce and the group's generation (auth.context)."""
        self.rank, self.size, self.group = rank, size, group
        # A key of its own: a tag on a plan or a store value, or of another launch or
        # generation of the group, is never valid here.
        self._mac = hmac.new(derive_key(secret, "bulk collectives", ctx), digestmod=hashlib.sha256)
        self.seq = 0  # the group's data collectives so far

    def _tag(self, kind: str, sender: int, receiver: int, payload: torch.Tensor) -> bytes:
        """The tag of one contribution (payload: contiguous uint8), over a numpy view of its bytes."""
        mac = self._mac.copy()  # the keyed state: no key schedule per message
        mac.update(struct.pack("<Qqq", self.seq, sender, receiver) + kind.encode())
        mac.update(payload.numpy().data)  # a memoryview of the buffer itself, hashed at C speed: no copy
        return mac.digest()

    def _sealed(self, kind: str, payload: torch.Tensor, receiver: int, into: torch.Tensor) -> None:
        """Write payload's bytes and their tag into ``into`` (uint8, len(payload) + TAG_BYTES)."""
        n = payload.numel()
        into[:n].copy_(payload)
        into[n:].copy_(torch.frombuffer(bytearray(self._tag(kind, self.rank, receiver, payload)), dtype=torch.uint8))

    def _check(self, kind: str, sender: int, receiver: int, sealed: torch.Tensor) -> None:
        """Unauthenticated unless sealed (payload bytes then tag) carries ``sender``'s tag."""
        n = sealed.numel() - TAG_BYTES
        tag = sealed[n:].numpy().tobytes()
        if not hmac.compare_digest(tag, self._tag(kind, sender, receiver, sealed[:n])):
            raise Unauthenticated(
                f"PCP {kind} message {self.seq} from rank {sender} failed authentication at rank {self.rank} "
                "(its HMAC does not match the launch secret): refused unused; something other than "
                f"rank {sender} wrote to the ranks' data channel, or that rank holds another cluster secret"
            )

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (P*n, ...): rank k's rows at [k*n, (k+1)*n)."""
        payload = _bytes(x)
        n = payload.numel()
        send = torch.empty(n + TAG_BYTES, dtype=torch.uint8)
        self._sealed("all_gather", payload, EVERY_RANK, send)
        recv = torch.empty(self.size * (n + TAG_BYTES), dtype=torch.uint8)
        _all_gather(recv, send, group=self.group)  # rank k's at [k*(n+TAG), (k+1)*(n+TAG))
        recv = recv.view(self.size, n + TAG_BYTES)
        for k in range(self.size):
            if k != self.rank:
                self._check("all_gather", k, EVERY_RANK, recv[k])
        self.seq += 1
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _bytes(out).view(self.size, n).copy_(recv[:, :n])
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """(P, m, ...) on every rank -> (P, m, ...): row k of the result is rank k's row ``self.rank``."""
        rows = _bytes(x).view(self.size, -1)
        n = rows.shape[1]
        send = torch.empty((self.size, n + TAG_BYTES), dtype=torch.uint8)
        for j in range(self.size):
            self._sealed("all_to_all", rows[j], j, send[j])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        for k in range(self.size):
            if k != self.rank:
                self._check("all_to_all", k, self.rank, recv[k])
        self.seq += 1
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _bytes(out).view(self.size, n).copy_(recv[:, :n])
        return out

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """(m, ...) on every rank -> (P, m, ...) on rank 0, None elsewhere."""
        payload = _bytes(x)
        n = payload.numel()
        send = torch.empty(n + TAG_BYTES, dtype=torch.uint8)
        self._sealed("gather_to_first", payload, 0, send)
        recv = torch.empty((self.size, n + TAG_BYTES), dtype=torch.uint8) if self.rank == 0 else None
        dist.gather(send, list(recv) if recv is not None else None, dst=0, group=self.group)
        if recv is None:
            self.seq += 1
            return None
        for k in range(1, self.size):
            self._check("gather_to_first", k, 0, recv[k])
        self.seq += 1
        out = x.new_empty((self.size, *x.shape))
        _bytes(out).view(self.size, n).copy_(recv[:, :n])
        return out

    def broadcast_(self, x: torch.Tensor) -> None:
        """Rank 0's x into every other rank's x (same shape and dtype, contiguous), in
        place; x is written only once rank 0's tag checks."""
        payload = _bytes(x)
        n = payload.numel()
        buf = torch.empty(n + TAG_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            self._sealed("broadcast", payload, EVERY_RANK, buf)
        dist.broadcast(buf, src=0, group=self.group)
        if self.rank != 0:
            self._check("broadcast", 0, EVERY_RANK, buf)
            payload.copy_(buf[:n])
        self.seq += 1
