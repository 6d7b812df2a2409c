"""Building and loading the kernel library (the package's docstring says what and why).

Every C++ file of the package is built into one library, whose name hashes the
sources, the flags, the compiler and the CPU's flags, under ``<cache>/kernels``
if that directory may be used (ctxpar.paths), else under a private temporary
directory; its functions get their ctypes signatures (signatures.py) on load.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loaded first: the library then shares its libgomp, so set_num_threads rules both)

from ctxpar.kernels.signatures import SIGNATURES
from ctxpar.machine import cpu_info
from ctxpar.paths import cache_dir, refusal, temporary_dir, warn_refused

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.cpp"))  # built together into one library


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


def library_name(flags: list[str], compiler_version: str) -> str:
    """The library's file name, ``ctxpar_kernels-<key>.so``: the key hashes the
    sources, the flags, the compiler and the CPU's flags."""
    texts = [f.read_text() for f in [*SOURCES, *sorted(HERE.glob("*.h"))]]
    parts = [*texts, *flags, compiler_version, " ".join(sorted(cpu_info().flags))]
    return f"ctxpar_kernels-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"


MARCH_ENV = "CTXPAR_KERNELS_MARCH"  # the build's target CPU where the caller names none (bench kernels --march)


def target_cpu() -> str:
    """The ``-march`` of the library that the kernels load: ``$CTXPAR_KERNELS_MARCH`` (a
    GCC CPU name, to time another CPU's code path here: ``haswell`` for AVX2, ``alderlake``
    for AVX-VNNI), else ``native``."""
    march = os.environ.get(MARCH_ENV, "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a CPU name: use one of GCC's -march names, e.g. haswell")
    return march


@cache
def library(march: str | None = None) -> ctypes.CDLL | None:
    """The built kernel library, building it if needed; None if it cannot be built.
    march: the target CPU (default target_cpu(): this one; the tests also build an
    AVX2-only ``haswell`` library to check the code path of CPUs without AVX-512)."""
    flags = [*FLAGS, f"-march={march or target_cpu()}"]
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(
            f"ctxpar: no C++ compiler ({compiler}: {e}); attention runs on the slower PyTorch path. "
            "Install g++ (or set CXX) to build ctxpar's kernels."
        )
        return None
    path = _trusted_library(_build_dir() / library_name(flags, version))
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
