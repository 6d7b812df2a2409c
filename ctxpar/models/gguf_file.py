"""A GGUF file's tensors as views of a read-only memory map (its header: ctxpar/gguf_header.py).

The map's pages are the page cache's, shared by every process that maps the
same file. ``read_ahead`` has the OS read them ahead of the loader's copies:
faults on a map read a file not in the page cache one readahead window at a
time, each waiting on the disk while nothing is copied, a few times slower
than the disk reads it whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ctxpar.gguf_header import GGUFHeader

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value, where Python does not name it
READ_AHEAD = 256 << 20  # bytes read_ahead keeps the OS reading past the tensor being copied
DEFAULT_READAHEAD = 128 << 10  # Linux's readahead window where a device states none


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(address, length, advice), None where there is no libc to call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_libc_madvise = _madvise()
_PREFETCHED: set[Path] = set()  # the files ``prefetch`` has read (or is reading)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first, as the file lists it
    data: np.ndarray  # (rows, bytes a row) uint8: a view of the mapped file
    offset: int  # of its first byte in the file


class GGUFFile:
    """metadata: the scalar and string fields; array_lengths: each array field's
    element count; tensors: in the file's order."""

    def __init__(self, path: Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self._path = path
        self._read_to = 0  # read_ahead asked the OS for the bytes before this
        self._advice_bytes = _readahead_bytes(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # The page cache holds a file in large folios where its file system can (ext4,
            # xfs); so advised, the map takes them as 2 MB pages, and the weights the kernels
            # read in place cost the TLB what huge pages do (with 4 KB pages an 8B model's
            # decode step is much slower: a miss and a page walk every 4 KB it streams).
            self._map.madvise(mmap.MADV_HUGEPAGE)
        header = GGUFHeader(self._map)
        self.metadata, self.array_lengths = header.metadata, header.array_lengths
        start = header.data_start
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self._address: int = whole.ctypes.data  # the map's first byte, for libc's madvise
        self.tensors: list[GGUFTensor] = []
        for name, dims, type_id, offset in header.tensors:
            kind = GGMLQuantizationType(type_id)
            block, nbytes = GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[1:], dtype=np.int64))
            row_bytes = dims[0] // block * nbytes
            at = start + offset
            if dims[0] % block or at + rows * row_bytes > len(whole):
                raise ValueError(f"tensor {name!r} ({kind.name}, {dims}) lies outside the file or splits a block")
            self.tensors.append(GGUFTensor(name, kind, dims, whole[at : at + rows * row_bytes].reshape(rows, -1), at))

    def read_ahead(self, tensor: GGUFTensor) -> None:
        """Have the OS read the file into the page cache from ``tensor`` on, READ_AHEAD
        bytes past its end, without waiting (the reads run while the caller copies what
        is read already); what earlier calls asked for is not asked again. Where the
        pages are cached already this is a quick walk over them; without
        ``posix_fadvise``, nothing."""
        end = min(len(self._map), tensor.offset + tensor.data.nbytes + READ_AHEAD)
        if not hasattr(os, "posix_fadvise") or self._read_to >= end:
            return
        with open(self._path, "rb") as f:
            for at in range(max(self._read_to, tensor.offset), end, self._advice_bytes):
                os.posix_fadvise(f.fileno(), at, min(self._advice_bytes, end - at), os.POSIX_FADV_WILLNEED)
        self._read_to = end

    def populate(self, tensor: GGUFTensor) -> None:
        """Map the tensor's pages now (reading them first where the page cache lacks them),
        so that a loaded model runs at its speed from its first step, not at the disk's.
        Without ``MADV_POPULATE_READ`` (Linux before 5.14) the first reads fault them in.
        Called through libc, which lets other threads run while it waits on the disk
        (mmap.madvise holds the interpreter: the loader builds the tokenizer meanwhile)."""
        first = tensor.offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._map), tensor.offset + tensor.data.nbytes)
        if _libc_madvise is not None:
            _libc_madvise(self._address + first, end - first, MADV_POPULATE_READ)  # failure: faults read it later
            return
        with contextlib.suppress(OSError):
            self._map.madvise(MADV_POPULATE_READ, first, end - first)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's mapping (the page cache keeps
        them): once its bytes are copied into the kernel's layout, the mapped copy
        would count twice in the process's memory. Reading it again faults them back."""
        first = tensor.offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._map), tensor.offset + tensor.data.nbytes)
        self._map.madvise(mmap.MADV_DONTNEED, first, end - first)


def prefetch(path: Path) -> threading.Thread | None:
    """Start reading the whole file into the page cache on a thread of its own, and return
    it (None where there is no libc madvise): a load that starts it first finds the pages
    read by the time it maps each tensor, the disk's time spent while the interpreter
    builds the model and its tokenizer. The thread maps the file as ``GGUFFile`` does (advised
    huge, so the page cache takes it in the same large folios) and populates the map
    through libc, which lets the other threads run; its map is closed when it is done.
    A file this process prefetched already is not read again (None)."""
    key = path.resolve()
    if _libc_madvise is None or key in _PREFETCHED:
        return None
    _PREFETCHED.add(key)
    with open(path, "rb") as f:
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        whole.madvise(mmap.MADV_HUGEPAGE)

    def populate(madvise: Callable[[int, int, int], int] = _libc_madvise) -> None:
        view = np.frombuffer(whole, dtype=np.uint8)  # the map stays open while the thread reads it
        madvise(view.ctypes.data, len(whole), MADV_POPULATE_READ)  # failure: the loader's own reads read it
        del view
        whole.close()

    thread = threading.Thread(target=populate, name="ctxpar-prefetch", daemon=True)
    thread.start()
    return thread


def _readahead_bytes(path: Path) -> int:
    """The most one WILLNEED advice reads: the device's readahead window (Linux caps an
    advice there), from sysfs where the file system's device has one, else Linux's default."""
    dev = path.stat().st_dev
    try:
        kib = int((Path("/sys/class/bdi") / f"{os.major(dev)}:{os.minor(dev)}" / "read_ahead_kb").read_text())
    except (OSError, ValueError):
        return DEFAULT_READAHEAD
    return max(DEFAULT_READAHEAD, kib << 10)  # 0 (readahead off): Linux caps at the device's I/O size, no less
