"""What this machine's CPU is: read once from /proc/cpuinfo (the dtype choice,
the kernels' build flags and the benchmarks' machine line all ask)."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class CpuInfo:
    model: str  # e.g. "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    flags: frozenset[str]  # ISA flags ("avx2", "avx512_bf16", ...; "asimd" on ARM)


@cache
def cpu_info() -> CpuInfo:
    """The first CPU's model name and flags; the platform's processor name and no
    flags where /proc/cpuinfo cannot be read."""
    model, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return CpuInfo(model or platform.processor() or platform.machine(), flags)
