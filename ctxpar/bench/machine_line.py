"""One line naming the machine a benchmark ran on, printed with its figures."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

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


def kernel_clock(per_core: bool) -> Callable[[], float]:
    """The clock a kernel benchmark times with: per_core, PyTorch on one thread and the
    thread's CPU time (what a core gives, whatever else the machine runs); else wall time."""
    if not per_core:
        return time.perf_counter
    import torch  # here: the machine line is printed by benchmarks that never load torch

    torch.set_num_threads(1)
    return time.thread_time
