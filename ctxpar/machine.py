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


@dataclass(frozen=True)
class MemoryUse:
    """A process's resident memory (bytes), by what backs it (Linux's /proc/PID/status)."""

    resident: int  # VmRSS: all of it
    anonymous: int  # RssAnon: its own heap (weights copied into the kernels' layout, the KV cache)
    file_mapped: int  # RssFile: pages of mapped files (the page cache's: a GGUF being read)
    shared: int  # RssShmem: shared memory (the PCP ranks' one copy of the weights)


def memory_use(pid: int) -> MemoryUse | None:
    """Process ``pid``'s MemoryUse, or None where /proc cannot tell (not Linux, gone)."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024  # reported in kB
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    return MemoryUse(fields["VmRSS"], fields["RssAnon"], fields["RssFile"], fields["RssShmem"])
