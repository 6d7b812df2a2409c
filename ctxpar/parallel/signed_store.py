"""A rendezvous store whose values carry an HMAC of the launch secret.

The ranks' TCPStore is a plain key-value server: whoever reaches its port can
list, read and write every key. Each value a rank writes through a
SignedStore is stored behind a tag over its key and value; each value it
reads is returned only once the tag checks. Wrapped in PrefixStores, it sees
full key names, so a value copied to another key (another generation of the
group, another rank's key) fails its check as a forged one does. The process
group's own keys (gloo's and NCCL's peer addresses) go through it too: a
store that lies about a peer is refused before any rank connects to the lie.

Counters (``add``) cannot carry a tag; ctxpar does not use them, torch's
store barriers do, and a forged count can only stall or fail them. Nor does a
key's existence (``check``, ``wait``) prove anything: the ranks count a
presence key (``started/r``, ``ready/r``, ``alive/g/r``, a segment's
``mapped/r``, a heartbeat) only once its value's tag checks
(``signed_present``), and a forged one is not counted; a value read for what
it says (a verdict, a segment's name) raises Unauthenticated when forged.

A store implemented in Python lives only as long as its Python object: the
stores torch builds on it (PrefixStore, the process groups) hold the C++ part
alone. Whoever creates a SignedStore keeps a reference to it for as long as
anything built on it is used.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import timedelta
from typing import cast

import torch.distributed as dist

from ctxpar.parallel.auth import TAG_BYTES, Unauthenticated, derive_key


class SignedStore(dist.Store):
    """``inner`` (a TCPStore, the ranks' meeting point) with every value tagged."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        self.inner = inner
        self._mac = hmac.new(derive_key(secret, "store values"), digestmod=hashlib.sha256)

    def _tag(self, key: str, value: bytes) -> bytes:
        mac = self._mac.copy()
        encoded = key.encode()
        mac.update(len(encoded).to_bytes(8, "little") + encoded)
        mac.update(value)
        return mac.digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, cast(str, self._tag(key, data) + data))  # the store takes bytes as well

    def get(self, key: str) -> bytes:
        stored = self.inner.get(key)
        value = stored[TAG_BYTES:]
        if len(stored) < TAG_BYTES or not hmac.compare_digest(stored[:TAG_BYTES], self._tag(key, value)):
            raise Unauthenticated(
                f"the rendezvous store's value of {key!r} failed authentication (no rank of this launch wrote "
                "it): refused; something else reached the store, whose port must not be reachable by others"
            )
        return value

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def read_signed(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key`` on a store built on a SignedStore, or None while it is
    absent or its tag fails (a forged value is not acted on; the rank that should
    write it overwrites it)."""
    try:
        return store.get(key) if store.check([key]) else None
    except Unauthenticated:
        return None


def signed_present(store: dist.Store, keys: list[str]) -> bool:
    """Whether every key is set with a value whose tag checks (presence keys)."""
    return store.check(keys) and all(read_signed(store, k) is not None for k in keys)


def wait_signed(store: dist.Store, keys: list[str], timeout: timedelta, poll_s: float = 0.01) -> None:
    """Wait until ``signed_present(store, keys)``; the store's timeout error after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    store.wait(keys, timeout)
    while not signed_present(store, keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no value of {keys} passed its check within {timeout.total_seconds():g} s")
        time.sleep(poll_s)
