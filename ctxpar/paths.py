"""Where ctxpar keeps what it builds or converts once, and the checks that make
loading from there safe: ``$CTXPAR_CACHE``, else ``~/.cache/ctxpar`` (compiled
kernels in ``kernels/``, converted GGUF files in ``gguf/``, benchmark drafts in
``first-layers/``).

What ctxpar loads from its cache acts as the engine's user: a kernel library is
``dlopen``-ed, converted weights, tokenizer and chat template are served. So a
cache directory or file is used only if it is not a symbolic link, belongs to
this user (or to root) and neither its group nor other users can write it;
directories ctxpar creates there are 0700. A cache that fails the check is
refused with a warning that names it and the fix; one that cannot be written
is passed over quietly (a read-only home). Either way the work then goes to a
fresh private directory under the system's temporary one (``mkdtemp``: a name
nobody can guess or claim first), removed when the process exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import warnings
from functools import cache
from pathlib import Path


def cache_root() -> Path:
    """``$CTXPAR_CACHE``, else ``~/.cache/ctxpar`` (not checked: see ``cache_dir``)."""
    return Path(os.environ.get("CTXPAR_CACHE") or "~/.cache/ctxpar").expanduser()


def refusal(path: Path) -> str | None:
    """Why ``path`` may not be trusted, or None if it may: it is a directory or a
    regular file (not a symbolic link), owned by this user or root, and not
    writable by its group or by other users. Looked at with ``lstat``: a link
    is refused, never followed. Raises OSError (FileNotFoundError) if it cannot be looked at."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "is neither a regular file nor a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    writers = [who for bit, who in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "other users")) if st.st_mode & bit]
    if writers:
        return f"can be written by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def tree_refusal(path: Path) -> str | None:
    """``refusal`` of ``path`` ("it ...") and of everything under it (naming the
    first entry refused); None: all may be trusted. Links are refused, never followed."""
    why = refusal(path)
    if why is not None:
        return f"it {why}"
    for top, dirs, files in os.walk(path):  # links are listed, never followed
        for name in sorted(dirs + files):
            why = refusal(Path(top, name))
            if why is not None:
                return f"{Path(top, name)} {why}"
    return None


def warn_refused(what: str, why: str) -> None:
    """The warning for a refused cache entry: what, why, and how to fix it."""
    warnings.warn(
        f"ctxpar: not using {what}: {why}. Whoever can write it could run code as you or change "
        "the model you serve. Remove it, or make it yours and private (chown $USER; chmod go-w), "
        "or set CTXPAR_CACHE to a private directory; a fresh private directory is used meanwhile",
        stacklevel=2,
    )


def cache_dir(name: str, cost: str | None = None) -> Path | None:
    """``<cache>/<name>``, created 0700 if absent; None if it may not or cannot be
    used: the cache root or this directory is refused (a warning says why and
    what to do) or cannot be written (a warning too if ``cost`` says what that
    costs). Callers then work in a private temporary directory."""
    root = cache_root()
    path = root / name
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        for d in (root, path):
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:
                pass
            why = refusal(d)
            if why is not None:
                warn_refused(f"the cache directory {d}", f"it {why}")
                return None
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot write {path}")
    except OSError as e:  # a read-only home, a file in the way
        if cost is not None:
            warnings.warn(
                f"ctxpar: the cache {root} cannot be used ({e}): {cost}; set CTXPAR_CACHE to a writable directory"
            )
        return None
    return path


def temporary_dir(name: str) -> Path:
    """A private directory (0700, a ``mkdtemp`` name) under the system's temporary
    one for ``name``'s files, the same one for the life of the process (one
    kernel build serves every load); removed at exit."""
    return _temporary_dir(name, tempfile.gettempdir())


@cache
def _temporary_dir(name: str, parent: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"ctxpar-{name}-", dir=parent))
    atexit.register(_remove, path, os.getpid())
    return path


def _remove(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the exit hooks, not the directory
        shutil.rmtree(path, ignore_errors=True)


def make_private(path: Path) -> None:
    """Leave ``path`` and everything under it writable by this user alone (files
    that libraries wrote under a permissive umask, e.g. 002, included), so a
    later ``tree_refusal`` accepts what ctxpar itself made."""
    entries = [path]
    for top, dirs, files in os.walk(path):  # links are listed, never followed
        entries += [Path(top, name) for name in dirs + files]
    for entry in entries:
        st = os.lstat(entry)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
            os.chmod(entry, stat.S_IMODE(st.st_mode) & ~0o022)
