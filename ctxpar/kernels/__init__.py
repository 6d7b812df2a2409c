"""Compiled CPU kernels, built on first use.

A kernel is a C++ file next to this one that includes no PyTorch header, so
``g++ -O3 -march=native -fopenmp`` builds it in about a second (a PyTorch
extension takes a minute). The library lands in ``<cache>/kernels`` under a
name that hashes the source, the flags, the compiler and the CPU's flags (a
cache shared between machines never serves one CPU's build to another), and
is called through ctypes with the tensors' data pointers. Its OpenMP threads
are PyTorch's own: both load the same ``libgomp.so.1``, so
``torch.set_num_threads`` rules both.

``CTXPAR_KERNELS=0`` turns the kernels off (the PyTorch path then runs, as
it does on a device other than the CPU). Without a working compiler they are
off too, with one warning that says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

from ctxpar.models.gguf import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
SOURCE = Path(__file__).with_name("paged_decode.cpp")
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGS = [_ptr, _ptr, _ptr, _ptr] + [_i64] * 8 + [_f32, _ptr, _ptr]


def enabled() -> bool:
    return os.environ.get("CTXPAR_KERNELS", "1") != "0"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@cache
def _library() -> ctypes.CDLL | None:
    """The built kernel library, building it if needed; None if it cannot be built."""
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(f"ctxpar: no C++ compiler ({compiler}: {e}); decode attention runs on the slower PyTorch path. "
                      "Install g++ (or set CXX) to build ctxpar's kernels.")
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_flags()]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"paged_decode-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build under a temporary name, then rename: ranks that start together may
        # build at once, and none may load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        build = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if build.returncode != 0:
            os.unlink(tmp)
            warnings.warn(f"ctxpar: building {SOURCE.name} failed; decode attention runs on the slower PyTorch "
                          f"path:\n{build.stderr[-2000:]}")
            return None
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        getattr(lib, name).argtypes = _ARGS
        getattr(lib, name).restype = None
    return lib


def usable(cache: torch.Tensor, *widths: int) -> bool:
    """Whether the kernels serve attention over this cache with keys and values
    of these widths: a contiguous float32 or bfloat16 CPU tensor, widths that are
    multiples of 8 (the kernel's vectors), kernels enabled and built."""
    return (
        cache.device.type == "cpu"
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.is_contiguous()
        and all(w % 8 == 0 for w in widths)
        and enabled()
        and _library() is not None
    )


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    kv_heads: int,
    value_dim: int,
    strides: tuple[int, int, int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over that row's cache slots, read in place.

    q (B, H, D); cache: a ``usable`` cache; slots (N,) int64 the rows' slots
    back to back, row b's at [starts[b], starts[b+1]) (starts (B+1,) int64);
    strides: in cache elements, (per slot, per KV head, from a key to its
    value). Query head i uses KV head i // (H / kv_heads). Returns out
    (B, H, value_dim) and lse (B, H), float32; a row without keys gets out 0
    and lse -inf.
    """
    rows, heads, dim = q.shape
    q = q.to(torch.float32).contiguous()
    slots, starts = slots.contiguous(), starts.contiguous()
    out = torch.empty(rows, heads, value_dim, dtype=torch.float32)
    lse = torch.empty(rows, heads, dtype=torch.float32)
    kernel = _library().paged_decode_f32 if cache.dtype == torch.float32 else _library().paged_decode_bf16
    kernel(q.data_ptr(), cache.data_ptr(), slots.data_ptr(), starts.data_ptr(), rows, heads, kv_heads, dim,
           value_dim, *strides, scale, out.data_ptr(), lse.data_ptr())
    return out, lse
