"""One line naming the machine a benchmark ran on, printed with its figures."""

from __future__ import annotations

import os
import platform

# CPU flags that decide which matmul and attention kernels run.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sve")


def describe_machine() -> str:
    """CPU model, core count, the relevant ISA flags, and the load average
    (figures measured on a loaded machine are slower and noisier)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    have = [f for f in RELEVANT_FLAGS if f in flags] or ["unknown"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"CPU: {model}, {os.cpu_count()} cores, flags {' '.join(have)}; load average {load:.1f}"
