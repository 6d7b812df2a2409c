"""models/gguf_file.py's ``prefetch``: a file out of the page cache is in it once the
thread is done, as the kernel's own record of resident pages (mincore) says."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from ctxpar.models.gguf_file import prefetch


def resident_fraction(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (mincore over a fresh map of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(whole, dtype=np.uint8)
    pages = -(-len(whole) // mmap.PAGESIZE)
    vec = np.zeros(pages, dtype=np.uint8)
    assert libc.mincore(view.ctypes.data, len(whole), vec.ctypes.data) == 0, os.strerror(ctypes.get_errno())
    del view
    whole.close()
    return float((vec & 1).mean())


def test_prefetch_reads_the_whole_file_into_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back, so that the advice below may drop the pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_fraction(path) > 0.5:
        pytest.skip("this file system keeps the file's pages whatever it is advised (tmpfs)")
    thread = prefetch(path)
    assert thread is not None, "Linux has a libc madvise"
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert resident_fraction(path) == 1.0
