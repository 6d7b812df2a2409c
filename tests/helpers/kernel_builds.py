"""The kernel builds the tests run besides this CPU's own, and this CPU's shared with a child process."""

from __future__ import annotations

import shutil
from pathlib import Path

from ctxpar.kernels import build
from ctxpar.machine import cpu_info

# On a CPU with AMX, its tiles take prefill's rows: the VNNI loop that CPUs without AMX
# run for every row count is tested through the build for such a CPU (cascadelake).
VNNI_BUILD = ["cascadelake"] if {"amx_int8", "avx512_vnni"} <= set(cpu_info().flags) else []


def share_kernel_library(cache: Path) -> None:
    """Put a copy of the kernel library this process loaded where a process whose
    ``CTXPAR_CACHE`` is ``cache`` looks for it (private, as ctxpar makes it), so that
    process loads it instead of spending seconds building it again."""
    lib = build.library()
    if lib is None:
        return
    kernels = cache / "kernels"
    kernels.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not (kernels / Path(lib._name).name).exists():  # this process may have built it there
        shutil.copy2(lib._name, kernels)
