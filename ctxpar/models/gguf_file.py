"""A GGUF file's header, and its tensors as views of a read-only memory map.

The ``gguf`` package's reader turns every element of every metadata array
(a vocabulary's 50-150K strings, its merges) into numpy objects, seconds
for a large vocabulary; loading needs the scalars, the tensors' places and
an array's length only. So this reads the header once, with the array
elements skipped, and maps the file read-only: a tensor's bytes are the
page cache's pages, shared by every process that maps the same file.
``read_ahead`` has the OS read them ahead of the loader's copies: faults on a
map read a file not in the page cache one readahead window at a time, each
waiting on the disk while nothing is copied, a few times slower than the disk
reads it whole.

Layout (ggml's gguf.md, versions 2 and 3, little-endian):

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x    (string key, u32 type, value)          string = u64 length + bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 type, u64 offset)
    padding to general.alignment (32)
    tensor data: each at data start + its offset
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# value type -> struct format of a scalar (8 string, 9 array: read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
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
        self._pos = 0
        if self._take(4) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        version = self._read("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; ctxpar reads versions 2 and 3")
        n_tensors, n_kv = self._read("Q"), self._read("Q")
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key, kind = self._string(), self._read("I")
            if kind == _ARRAY:
                self.array_lengths[key] = self._skip_array()
            else:
                self.metadata[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._read("I")
            dims = tuple(self._read("Q") for _ in range(n_dims))
            infos.append((name, dims, GGMLQuantizationType(self._read("I")), self._read("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self._address: int = whole.ctypes.data  # the map's first byte, for libc's madvise
        self.tensors: list[GGUFTensor] = []
        for name, dims, kind, offset in infos:
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

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise ValueError("the header runs past the end of the file (truncated)")
        b = self._map[self._pos : self._pos + n]
        self._pos += n
        return b

    def _read(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._read("Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self._read(_SCALARS[kind])

    def _skip_array(self) -> int:
        kind, count = self._read("I"), self._read("Q")
        if kind == _STRING:
            # A vocabulary's 50-150K strings, each a u64 length then its bytes: walked with one
            # unpack each, not _read's three calls (a tenth of a second per 100K on a start).
            pos, size, length_at = self._pos, len(self._map), _U64.unpack_from
            for _ in range(count):
                if pos + 8 > size:
                    raise ValueError("the header runs past the end of the file (truncated)")
                pos += 8 + length_at(self._map, pos)[0]
            if pos > size:
                raise ValueError("the header runs past the end of the file (truncated)")
            self._pos = pos
        elif kind == _ARRAY:
            for _ in range(count):
                self._skip_array()
        elif kind in _SCALARS:
            self._take(count * struct.calcsize(_SCALARS[kind]))
        else:
            raise ValueError(f"unknown metadata array type {kind}")
        return count


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
