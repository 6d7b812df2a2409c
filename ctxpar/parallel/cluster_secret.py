"""The secret the hosts of a torchrun job share.

Spawned ranks get a fresh secret from rank 0 (auth.new_secret). Ranks that
torchrun starts on several hosts cannot: they must already share one, given
in the environment of every rank, as ``CTXPAR_CLUSTER_SECRET`` (the secret
itself) or ``CTXPAR_CLUSTER_SECRET_FILE`` (a file holding it, which must be
this user's and readable by nobody else). Without either the ranks refuse to
start, unless ``CTXPAR_INSECURE_CLUSTER=1`` says that the network between the
hosts is trusted with everything: then anyone who reaches the rendezvous
port can forge the ranks' messages (and so steer or stop them; the messages
are data, never code: ctxpar/worker/plan_wire.py).

Whoever reads the store can read tagged values, and test guesses of the
secret against their tags offline. So a secret is refused unless it is long
and varied enough to be out of reach of guessing (an estimate from its
characters: a random string of at least MIN_BITS bits passes, a word, a
repeated pattern or a run of consecutive characters does not), and the ranks
key their tags with a stretch of it (scrypt: each guess costs a guesser
tens of milliseconds and 16 MiB, not a microsecond).
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import warnings
from collections import Counter

from ctxpar.errors import CtxparError

ENV = "CTXPAR_CLUSTER_SECRET"
FILE_ENV = "CTXPAR_CLUSTER_SECRET_FILE"
INSECURE_ENV = "CTXPAR_INSECURE_CLUSTER"
MIN_CHARS = 32  # `openssl rand -hex 32` gives 64
MIN_BITS = 128  # estimated (estimated_bits): `openssl rand -hex 32` gives ~230
MAX_FILE_BYTES = 4096
# scrypt's cost: ~30 ms and 16 MiB per guess (and once per rank at start-up).
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1

_HOW = (
    f"give every rank the same random secret: export {ENV}=$(openssl rand -hex 32) on each host (or "
    f"{FILE_ENV}=<a file of yours, mode 0600, holding it>); {INSECURE_ENV}=1 runs without one, "
    "letting anyone who reaches the rendezvous port forge the ranks' messages"
)


def cluster_secret() -> bytes:
    """The torchrun job's shared secret. CtxparError naming the fix when there is none
    (or it is too short, or its file is unsafe); b"" with a warning under the explicit opt-out."""
    value = os.environ.get(ENV)
    path = os.environ.get(FILE_ENV)
    if value is not None and path is not None:
        raise CtxparError(f"both {ENV} and {FILE_ENV} are set; set one")
    if path is not None:
        value = _read_secret_file(path)
    if value is not None:
        secret = value.strip()
        where = FILE_ENV if path is not None else ENV
        if len(secret) < MIN_CHARS:
            raise CtxparError(f"the secret in {where} is {len(secret)} characters; use at least {MIN_CHARS}: {_HOW}")
        bits = estimated_bits(secret)
        if bits < MIN_BITS:
            raise CtxparError(
                f"the secret in {where} is too predictable (about {bits:.0f} bits of entropy estimated from its "
                f"characters, {MIN_BITS} needed: a word, a repeated pattern or a run of characters); {_HOW}"
            )
        return stretch(secret.encode())
    if os.environ.get(INSECURE_ENV) == "1":
        warnings.warn(
            f"ctxpar: {INSECURE_ENV}=1: the torchrun ranks' messages are not authenticated; anyone who "
            "reaches the rendezvous port can steer or stop them",
            stacklevel=2,
        )
        return b""
    raise CtxparError(f"ranks started by torchrun need a shared secret, and none is set: {_HOW}")


def stretch(secret: bytes) -> bytes:
    """The 32-byte key the ranks derive everything from (auth.derive_key): scrypt
    of the secret, so that testing a guess of it against a tag costs what scrypt costs."""
    return hashlib.scrypt(secret, salt=b"ctxpar cluster secret", n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)


def estimated_bits(secret: str) -> float:
    """A cautious estimate of the secret's entropy in bits: the empirical entropy of
    the characters it uses, times the number of its characters that are surprises:
    neither part of a repeat of an earlier stretch of 3 or more (a repeat counts as
    one) nor the continuation of a run (each step the same as the one before:
    "aaaa", "abcd", "2468"). It undercounts a random string a little and cannot see
    words that are not repeated: generate the secret rather than choose it."""
    codes = [ord(c) for c in secret]
    surprises, i = 0, 0
    while i < len(secret):
        length = 0  # of the longest stretch from i that also starts earlier
        while i + length < len(secret) and secret.find(secret[i : i + length + 1], 0, i + length) != -1:
            length += 1
        if length >= 3:
            surprises, i = surprises + 1, i + length
            continue
        surprises += not (i >= 2 and codes[i] - codes[i - 1] == codes[i - 1] - codes[i - 2])
        i += 1
    counts = Counter(secret).values()
    per_char = -sum(n / len(secret) * math.log2(n / len(secret)) for n in counts)
    return surprises * per_char


def _read_secret_file(path: str) -> str:
    """The secret in ``path``, once it proves to be a regular file of this user that
    nobody else can read or write (not followed if it is a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise CtxparError(f"cannot open {FILE_ENV} {path!r} ({e.strerror}; a symlink is refused): {_HOW}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CtxparError(f"{FILE_ENV} {path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise CtxparError(f"{FILE_ENV} {path!r} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise CtxparError(
                f"{FILE_ENV} {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: others may read or change it; "
                f"chmod 600 {path}"
            )
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise CtxparError(f"{FILE_ENV} {path!r} is longer than {MAX_FILE_BYTES} bytes: not a secret file")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CtxparError(f"{FILE_ENV} {path!r} is not text; write the secret as text (openssl rand -hex 32)") from None
