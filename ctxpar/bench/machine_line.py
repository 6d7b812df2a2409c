"""One line naming the machine a benchmark ran on, printed with its figures."""

from __future__ import annotations

import os

from ctxpar.machine import cpu_info

# CPU flags that decide which matmul and attention kernels run.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def describe_machine() -> str:
    """CPU model, core count, the relevant ISA flags, and the load average
    (figures measured on a loaded machine are slower and noisier)."""
    cpu = cpu_info()
    model, flags = cpu.model, cpu.flags
    have = [f for f in RELEVANT_FLAGS if f in flags] or ["unknown"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(have)}; load average {load:.1f}"
