"""Compiled CPU kernels, built on first use.

The kernels are the C++ files next to this one, each wrapped in a module
here: attention, decode and prefill, over float, bf16 and quantized caches
(``attention_kernels.py``); fp32 and bf16 projections against packed weights
(``panels.py``); projections against block-quantized weights (``quant.py``);
the layers' elementwise steps (``elementwise.py``); a quantized KV cache's
writes (``kv_cache.py``). ``build.py`` builds and loads them, with the ctypes
signatures of ``signatures.py``. They include no PyTorch header, so
``g++ -O3 -march=native -fopenmp`` builds them into one library in a few
seconds (a PyTorch extension takes a minute). The library lands in
``<cache>/kernels`` under a name that hashes the sources, the flags, the
compiler and the CPU's flags (a cache shared between machines never serves one
CPU's build to another), and is called through ctypes with the tensors' data
pointers. Loading it runs its code, so the directory and the library must be
this user's and writable by nobody else (ctxpar.paths); otherwise the library
is built afresh in a private temporary directory. The kernels trust the
pointers and sizes they get: the wrappers check what a wrong layout would turn
into an out-of-bounds access, with real checks (``python -O`` drops
``assert``). Its OpenMP threads are PyTorch's own: both load the same
``libgomp.so.1``, so ``torch.set_num_threads`` rules both.

``CTXPAR_KERNELS=0`` turns the kernels off (the PyTorch path then runs, as
it does on a device other than the CPU). Without a working compiler they are
off too, with one warning that says so.
"""

from __future__ import annotations

import ctypes
import os

# ``_library`` is looked up here at each call, so a test or a benchmark may put
# another build of the library in its place (an AVX2-only one, say).
from ctxpar.kernels.build import FLAGS as FLAGS
from ctxpar.kernels.build import library as _library
from ctxpar.kernels.build import library_name as _library_name  # noqa: F401  (the cache tests name it)


def enabled() -> bool:
    """Whether the kernels may serve: ``CTXPAR_KERNELS`` is not 0."""
    return os.environ.get("CTXPAR_KERNELS", "1") != "0"


def available() -> bool:
    """Whether the kernels serve: enabled (CTXPAR_KERNELS is not 0) and built."""
    return enabled() and _library() is not None


def loaded() -> ctypes.CDLL:
    """The kernel library, for callers that checked ``available()`` (or a test that
    patched ``_library``): its absence here is a bug, not a fallback."""
    lib = _library()
    if lib is None:
        raise RuntimeError("ctxpar's kernels are not built; check kernels.available() before calling them")
    return lib
