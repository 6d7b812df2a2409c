"""The kernel builds the tests run besides this CPU's own."""

from __future__ import annotations

from ctxpar.machine import cpu_info

# On a CPU with AMX, its tiles take prefill's rows: the VNNI loop that CPUs without AMX
# run for every row count is tested through the build for such a CPU (cascadelake).
VNNI_BUILD = ["cascadelake"] if {"amx_int8", "avx512_vnni"} <= set(cpu_info().flags) else []
