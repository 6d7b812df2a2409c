"""The launch secret and what it authenticates.

Every launch of PCP ranks has one secret: drawn by rank 0 when it spawns the
ranks (each worker receives it in its spawn arguments, through the pipe
multiprocessing starts it with, never through the store), or shared by the
hosts of a torchrun job (cluster_secret.py). From it come

- the rendezvous store's key prefix, so nobody who reaches the store can
  guess where a launch's keys are;
- HMAC-SHA256 tags on every value written to the store (signed_store.py) and
  on every step plan rank 0 sends (``PlanSeal``): a rank acts on nothing, and
  unpickles nothing, whose tag it has not checked first.

Each use has a key of its own (derived from the secret and a label), so a tag
made for one use is never valid for another.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

TAG_BYTES = 32  # an HMAC-SHA256 tag
SECRET_BYTES = 32


class Unauthenticated(RuntimeError):
    """Bytes that claim to come from a rank of this launch failed their HMAC check:
    someone without the launch secret wrote them. The rank refuses them, unread."""


def new_secret() -> bytes:
    """A fresh launch secret (spawned ranks: one per executor)."""
    return secrets.token_bytes(SECRET_BYTES)


def derive_key(secret: bytes, label: str) -> bytes:
    """The key for one use of the secret (``label`` names the use)."""
    return hmac.new(secret, b"ctxpar key: " + label.encode(), hashlib.sha256).digest()


def store_prefix(secret: bytes) -> str:
    """The launch's key prefix on the rendezvous store: not guessable without the secret."""
    return f"ctxpar/{derive_key(secret, 'store prefix').hex()[:32]}/"


class PlanSeal:
    """Tags rank 0's messages to the other ranks (step plans, KV copies, the stop).

    Each message has a header (its length, tagged) and a payload (tagged), both
    over the message's number in the group's stream, so a recorded message
    cannot be replayed in another place of the stream. Every rank of a group
    counts the messages it sent or received; a group starts at number 0.
    """

    HEADER_BYTES = 8 + TAG_BYTES

    def __init__(self, secret: bytes) -> None:
        self._mac = hmac.new(derive_key(secret, "step plans"), digestmod=hashlib.sha256)
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
                "the launch secret): refused unread; something other than rank 0 wrote to the ranks' channel"
            )
        (n,) = struct.unpack("<q", size)
        return n

    def open_payload(self, sealed: bytes) -> bytes:
        """The body of a received payload, once its tag checks; counts the message as
        received. Unauthenticated if it is forged (the body is never decoded then)."""
        body = memoryview(sealed)[TAG_BYTES:]
        if not hmac.compare_digest(sealed[:TAG_BYTES], self._tag(b"P", body)):
            raise Unauthenticated(
                f"PCP message {self.seq} from rank 0 failed authentication (its HMAC does not match the launch "
                "secret): refused without unpickling it; something other than rank 0 wrote to the ranks' channel"
            )
        self.seq += 1
        return bytes(body)
