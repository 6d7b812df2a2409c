"""Opening a file that another process named, only if it is the one we expect.

A rank maps shared segments that rank 0 names on the rendezvous store. The
name is authenticated (signed_store.py), but the file behind it is checked as
well, so that nothing another user can write is ever mapped: it must be a
regular file (a symlink is not followed), owned by this user, mode 0600 (no
one else may read or write it) and of the size the ranks agreed on.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ctxpar.errors import RankFailure

MODE = 0o600


class UnsafeFile(RankFailure):
    """A file named to a rank is not one it may open: another user could have placed or changed it."""


def create_private(path: Path) -> int:
    """A new file at ``path`` (never an existing one, never through a symlink), mode
    0600 whatever the umask; returns its descriptor, open for reading and writing."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, MODE)
    os.fchmod(fd, MODE)
    return fd


def open_private(path: Path, nbytes: int, directory: Path) -> int:
    """Open ``path`` for reading and writing after checking that it lies in ``directory``,
    is a regular file (not a symlink), belongs to this user, has mode 0600 and nbytes
    bytes. Returns its descriptor; UnsafeFile naming what is wrong otherwise."""
    if path.parent != directory:
        raise _refuse(path, f"it is not in {directory}")
    try:
        # O_NONBLOCK: a FIFO put in its place cannot block the open.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        why = "it is a symlink" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise _refuse(path, why) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "it is not a regular file")
        if st.st_uid != os.geteuid():
            raise _refuse(path, f"it belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if stat.S_IMODE(st.st_mode) != MODE:
            raise _refuse(path, f"its mode is {stat.S_IMODE(st.st_mode):04o}, not {MODE:04o}")
        if st.st_size != nbytes:
            raise _refuse(path, f"it has {st.st_size} bytes, not the {nbytes} agreed")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse(path: Path, why: str) -> UnsafeFile:
    return UnsafeFile(
        f"refusing to map the shared segment {path}: {why} (a segment must be a regular file of this user, "
        "mode 0600, of the agreed size; another user may have put it there)"
    )
