"""Compiled CPU kernels, built on first use.

The kernels are the C++ files next to this one, each wrapped in a module
here: decode and prefill attention (``attention.py``); fp32 and bf16
projections against packed weights (``panels.py``); projections against
block-quantized weights (``quant.py``); the layers' elementwise steps
(``elementwise.py``); a quantized KV cache's writes and prefill reads
(``kv_cache.py``). This module builds and loads them. They include no PyTorch header, so
``g++ -O3 -march=native -fopenmp`` builds them into one library in a few
seconds (a PyTorch extension takes a minute). The library lands in ``<cache>/kernels`` under a name that
hashes the sources, the flags, the compiler and the CPU's flags (a
cache shared between machines never serves one CPU's build to another), and
is called through ctypes with the tensors' data pointers. Loading it runs its
code, so the directory and the library must be this user's and writable by
nobody else (ctxpar.paths); otherwise the library is built afresh in a private
temporary directory. The kernels trust the pointers and sizes they get: the
wrappers here check what a wrong layout would turn into an out-of-bounds
access, with real checks (``python -O`` drops ``assert``). Its OpenMP threads
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
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loaded first: the library then shares its libgomp, so set_num_threads rules both)

from ctxpar.machine import cpu_info
from ctxpar.paths import cache_dir, refusal, temporary_dir, warn_refused

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # built together into one library
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {  # name: (argument types, result type)
    "paged_decode_f32": ([_ptr] * 4 + [_i64] * 8 + [_f32, _ptr, _ptr], None),
    "paged_decode_bf16": ([_ptr] * 4 + [_i64] * 8 + [_f32, _ptr, _ptr], None),
    "paged_decode_quant": ([_ptr] * 4 + [_i64] * 13 + [_f32, _ptr, _ptr], None),
    "prefill_attention_f32": ([_ptr] * 3 + [_i64] * 10 + [_ptr, _f32, _ptr, _ptr], None),
    "prefill_attention_quant": ([_ptr] * 2 + [_i64] * 10 + [_ptr] + [_i64] * 4 + [_f32, _ptr, _ptr], None),
    "prefill_attention_supports": ([_i64, _i64], ctypes.c_int),
    "prefill_attention_bf16": ([_ptr] * 3 + [_i64] * 10 + [_ptr, _f32, _ptr, _ptr], None),
    "prefill_attention_bf16_supports": ([_i64, _i64], ctypes.c_int),
    "kv_quantize": ([_ptr, _i64, _i64, _ptr] + [_i64] * 4 + [_ptr], None),
    "rms_norm_f32": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _ptr], None),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr], None),
    "rope_f32": ([_ptr] + [_i64] * 4 + [_ptr, _ptr], None),
    "rms_norm_bf16": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _ptr], None),
    "silu_mul_bf16": ([_ptr, _i64, _i64, _ptr], None),
    "rope_bf16": ([_ptr] + [_i64] * 4 + [_ptr, _ptr], None),
    "hadamard_f32": ([_ptr] + [_i64] * 4 + [_f32], None),
    "linear_packed_f32": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_packed_bf16": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_packed_bf16_out": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], None),
    "linear_panel_width": ([], _i64),
    "linear_bf16_tiles": ([], _i64),
    "quant_linear_f32": ([_ptr, _i64, _i64, _i64, _ptr] + [_i64] * 5 + [_ptr, _ptr], None),
    "quant_dequantize_f32": ([_ptr] + [_i64] * 7 + [_ptr], None),
    "llama_decode_layers": ([_ptr, _i64, _ptr, _ptr] + [_i64] * 6 + [_f32] + [_ptr] * 5 + [_f32], None),
    "shm_barrier": ([_ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_double], _i64),
}


# A quantized cache's code dtypes, by the number the kernels know them by (kv_codes.h).
def enabled() -> bool:
    return os.environ.get("CTXPAR_KERNELS", "1") != "0"


def available() -> bool:
    """Whether the kernels serve: enabled (CTXPAR_KERNELS is not 0) and built."""
    return enabled() and _library() is not None


def _build_dir() -> Path:
    """``<cache>/kernels`` if it may be used (ctxpar.paths.cache_dir), else a private
    directory of this process under the system's temporary one."""
    return cache_dir("kernels") or temporary_dir("kernels")


def _trusted_library(path: Path) -> Path:
    """``path``, or the same name in a private temporary directory if a library
    there may not be loaded (dlopen runs its code): refused with a warning."""
    try:
        why = refusal(path)
    except FileNotFoundError:
        return path
    if why is None:
        return path
    warn_refused(f"the kernel library {path}", f"it {why}")
    return temporary_dir("kernels") / path.name


def loaded() -> ctypes.CDLL:
    """The kernel library, for callers that checked ``available()`` (or a test that
    patched ``_library``): its absence here is a bug, not a fallback."""
    lib = _library()
    if lib is None:
        raise RuntimeError("ctxpar's kernels are not built; check kernels.available() before calling them")
    return lib


def _library_name(flags: list[str], compiler_version: str) -> str:
    """The library's file name, ``ctxpar_kernels-<key>.so``: the key hashes the
    sources, the flags, the compiler and the CPU's flags."""
    texts = [f.read_text() for f in [*SOURCES, *sorted(HERE.glob("*.h"))]]
    parts = [*texts, *flags, compiler_version, " ".join(sorted(cpu_info().flags))]
    return f"ctxpar_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


@cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    """The built kernel library, building it if needed; None if it cannot be built.
    march: the target CPU (``native``: this one; the tests also build an AVX2-only
    ``haswell`` library to check the code path of CPUs without AVX-512)."""
    flags = [*FLAGS, f"-march={march}"]
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(
            f"ctxpar: no C++ compiler ({compiler}: {e}); attention runs on the slower PyTorch path. "
            "Install g++ (or set CXX) to build ctxpar's kernels."
        )
        return None
    path = _trusted_library(_build_dir() / _library_name(flags, version))
    if not path.exists():
        # Build under a temporary name, then rename: ranks that start together may
        # build at once, and none may load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        build = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if build.returncode != 0:
            os.unlink(tmp)
            warnings.warn(
                f"ctxpar: building the kernels in {HERE} failed; attention runs on the slower PyTorch "
                f"path:\n{build.stderr[-2000:]}"
            )
            return None
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask: keep it this user's alone
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))
    for name, (args, result) in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = result
    return lib
