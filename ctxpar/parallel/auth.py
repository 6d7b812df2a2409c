"""The launch secret, the launch's nonce, and what they authenticate.

Every launch of PCP ranks has one secret: drawn by rank 0 when it spawns the
ranks (each worker receives it in its spawn arguments, through the pipe
multiprocessing starts it with, never through the store), or shared by the
hosts of a torchrun job (cluster_secret.py). It also has a nonce, fresh for
every launch: drawn by rank 0 with the secret, or agreed by torchrun's ranks
(executor/launch_nonce.py), whose secret stays the same from one launch to
the next. From them come

- the rendezvous store's key prefix: the nonce itself, which is random and
  says nothing about the secret (a client of the store can list key names);
- HMAC-SHA256 tags on every value written to the store (signed_store.py, over
  the full key name, so over the nonce too) and on every message rank 0 sends
  (``PlanSeal``) and every rank's share of a tagged collective
  (sealed_collectives.py), under keys bound to the launch's nonce and the
  group's generation: a rank acts on nothing whose tag it has not checked
  first, and a message of another launch, or of another generation of the
  group, fails its check.

Each use has a key of its own (derived from the secret, a label and the
context: launch nonce and generation), so a tag made for one use or one
context is never valid for another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

TAG_BYTES = 32  # an HMAC-SHA256 tag
SECRET_BYTES = 32
NONCE_BYTES = 16


class Unauthenticated(RuntimeError):
    """Bytes that claim to come from a rank of this launch failed their HMAC check:
    someone without the launch secret wrote them, or they belong to another launch
    or another generation of the group. The rank refuses them, unread."""


def new_secret() -> bytes:
    """A fresh launch secret (spawned ranks: one per executor)."""
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> bytes:
    """A fresh launch nonce (spawned ranks: one per executor, beside the secret)."""
    return secrets.token_bytes(NONCE_BYTES)


def context(*parts: bytes) -> bytes:
    """Parts joined unambiguously (each behind its length): the context of a key."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def derive_key(secret: bytes, label: str, ctx: bytes = b"") -> bytes:
    """The key for one use of the secret (``label`` names the use) in one context
    (``ctx``: the launch's nonce and the group's generation, see ``context``)."""
    return hmac.new(secret, b"ctxpar key: " + label.encode() + b"\0" + ctx, hashlib.sha256).digest()


def store_prefix(nonce: bytes) -> str:
    """The launch's key prefix on the rendezvous store: its nonce, which is public
    once listed and derived from nothing secret."""
    return f"ctxpar/{nonce.hex()}/"


class PlanSeal:
    """Tags rank 0's messages to the other ranks (step plans, KV copies, the stop).

    Each message has a header (its length, tagged) and a payload (tagged), both
    over the message's number in the group's stream, so a recorded message
    cannot be replayed in another place of the stream; the key is bound to the
    launch's nonce and the group's generation (``ctx``), so a message recorded in
    another launch or another generation of the group (whose count also starts
    at 0) fails too. Every rank of a group counts the messages it sent or
    received; a group starts at number 0.
    """

    HEADER_BYTES = 8 + TAG_BYTES

    def __init__(self, secret: bytes, ctx: bytes) -> None:
        self._mac = hmac.new(derive_key(secret, "step plans", ctx), digestmod=hashlib.sha256)
        self.seq = 0

    def _tag(self, kind: bytes, data: bytes | memoryview) -> bytes:
        mac = self._mac.copy()  # the keyed state: no key schedule per message
        mac.update(kind + struct.pack("<Q", self.seq))
        mac.update(data)
        return mac.digest()

    def seal(self, body: bytes) -> tuple[bytes, bytes]:
        """The next message's tagged header and tagged payload; counts the message as sent."""
        size = struct.pack("<q", TAG_BYTES + len(body))
        header, payload = size + self._tag(b"H", size), self._tag(b"P", body) + body
        self.seq += 1
        return header, payload

    def open_header(self, header: bytes) -> int:
        """The payload size a received header announces; Unauthenticated if it is forged."""
        size = header[:8]
        if len(header) != self.HEADER_BYTES or not hmac.compare_digest(header[8:], self._tag(b"H", size)):
            raise Unauthenticated(
                f"PCP message {self.seq} from rank 0 failed authentication (its header's HMAC does not match "
                "the launch secret, launch and generation): refused unread; something other than rank 0 of "
                "this group wrote to the ranks' channel"
            )
        (n,) = struct.unpack("<q", size)
        return n

    def open_payload(self, sealed: memoryview) -> memoryview:
        """The body of a received payload (a view of ``sealed``), once its tag checks;
        counts the message as received. Unauthenticated if it is forged (the body is
        never decoded then)."""
        body = sealed[TAG_BYTES:]
        if not hmac.compare_digest(bytes(sealed[:TAG_BYTES]), self._tag(b"P", body)):
            raise Unauthenticated(
                f"PCP message {self.seq} from rank 0 failed authentication (its HMAC does not match the launch "
                "secret, launch and generation): refused undecoded; something other than rank 0 of this group "
                "wrote to the ranks' channel"
            )
        self.seq += 1
        return body
