"""A GGUF file's header (ggml's gguf.md, versions 2 and 3, little-endian),
read without the ``gguf`` package:

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x    (string key, u32 type, value)          string = u64 length + bytes
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 type, u64 offset)
    padding to general.alignment (32)
    tensor data: each at data start + its offset

The ``gguf`` package's reader turns every element of every metadata array
(a vocabulary's 50-150K strings, its merges) into numpy objects, seconds for
a large vocabulary; ctxpar needs the scalars, the tensors' places and an
array's length only, so array elements are skipped.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import Any

# value type -> struct format of a scalar (8 string, 9 array: read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# ggml's F32, F16 and F64: weights a loader widens to float32 (no quantized kernel keeps them).
FLOAT_TYPES = frozenset({0, 1, 28})


class GGUFHeader:
    """metadata: the scalar and string fields; array_lengths: each array field's element
    count; tensors: (name, dims innermost first, ggml type id, offset) in the file's order;
    data_start: where the tensor data begins."""

    def __init__(self, buf: Any) -> None:
        """buf: the file's bytes (a memory map: only the header's pages are read)."""
        self._buf, self._pos = buf, 0
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
        self.tensors: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._read("I")
            dims = tuple(self._read("Q") for _ in range(n_dims))
            self.tensors.append((name, dims, self._read("I"), self._read("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-self._pos // align) * align
        del self._buf  # the caller's map may close now

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise ValueError("the header runs past the end of the file (truncated)")
        b = self._buf[self._pos : self._pos + n]
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
            pos, size, length_at = self._pos, len(self._buf), _U64.unpack_from
            for _ in range(count):
                if pos + 8 > size:
                    raise ValueError("the header runs past the end of the file (truncated)")
                pos += 8 + length_at(self._buf, pos)[0]
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


def float_matrices_only(path: str | Path) -> bool:
    """Whether every matrix (tensor of two or more dimensions) of the GGUF file at ``path`` is
    F32, F16 or F64: then loading widens them all to float32 and nothing is computed from
    quantized blocks. False for a file that cannot be read (loading names the problem)."""
    try:
        stat = Path(path).stat()
        return _float_matrices_only(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=16)
def _float_matrices_only(path: str, mtime_ns: int, size: int) -> bool:
    """Cached by the file's identity and version (its time and size): a config asks more than once."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = GGUFHeader(buf)
    return all(kind in FLOAT_TYPES for _, dims, kind, _ in header.tensors if len(dims) >= 2)
