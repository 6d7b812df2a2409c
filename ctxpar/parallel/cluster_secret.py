"""The secret the hosts of a torchrun job share.

Spawned ranks get a fresh secret from rank 0 (auth.new_secret). Ranks that
torchrun starts on several hosts cannot: they must already share one, given
in the environment of every rank, as ``CTXPAR_CLUSTER_SECRET`` (the secret
itself) or ``CTXPAR_CLUSTER_SECRET_FILE`` (a file holding it, which must be
this user's and readable by nobody else). Without either the ranks refuse to
start, unless ``CTXPAR_INSECURE_CLUSTER=1`` says that the network between the
hosts is trusted with everything: then anyone who reaches the rendezvous
port can forge the ranks' messages.
"""

from __future__ import annotations

import os
import stat
import warnings

from ctxpar.errors import CtxparError

ENV = "CTXPAR_CLUSTER_SECRET"
FILE_ENV = "CTXPAR_CLUSTER_SECRET_FILE"
INSECURE_ENV = "CTXPAR_INSECURE_CLUSTER"
MIN_CHARS = 16  # `openssl rand -hex 32` gives 64
MAX_FILE_BYTES = 4096

_HOW = (
    f"give every rank the same secret: export {ENV}=$(openssl rand -hex 32) on each host (or "
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
        if len(secret) < MIN_CHARS:
            where = FILE_ENV if path is not None else ENV
            raise CtxparError(f"the secret in {where} is {len(secret)} characters; use at least {MIN_CHARS}: {_HOW}")
        return secret.encode()
    if os.environ.get(INSECURE_ENV) == "1":
        warnings.warn(
            f"ctxpar: {INSECURE_ENV}=1: the torchrun ranks' messages are not authenticated; anyone who "
            "reaches the rendezvous port can steer or stop them",
            stacklevel=2,
        )
        return b""
    raise CtxparError(f"ranks started by torchrun need a shared secret, and none is set: {_HOW}")


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
