"""Built-in hardware profiles (per CP rank).

Peaks are vendors' datasheet figures; efficiency factors say what fraction is
reached. The H100 node profiles' GEMM and attention efficiencies and ring-step
overhead were fitted once, jointly, to Meta's published TTFT table
(costmodel/published.py; the fit and its residuals are in docs/benchmarks.md)
and are not tuned per row; the TP2 profile's GEMM efficiency to one row of
NVIDIA's (docs/scaling.md, "Decode and short prefills"). The CPU profiles are `ctxpar calibrate` runs on the
2-core development VM (measured rates, efficiency 1).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ctxpar.costmodel.hardware import HardwareProfile, profile_from_dict
from ctxpar.errors import CtxparError

GB, GIB = 1e9, float(1 << 30)

# The fixed costs of a step on a GPU serving engine (ctxpar/costmodel/fixed_costs.py): kernels
# queued asynchronously; decode steps replayed from CUDA graphs, 0.95 us a kernel on the device
# (ctxpar's `bench cuda` launch test on an H200, docs/benchmarks.md "First run on a GPU"); an
# eager launch from Python 11.8 us (the same test, an upper bound for a C++ engine's); 12
# kernels a decoder layer, as vLLM's Llama layer under TP launches them (two fused add +
# RMSNorm, QKV, rope, cache write, attention, O, all-reduce, gate-up, SiLU x up, down,
# all-reduce); TP all-reduces one-shot over NVLink (vLLM's and TensorRT-LLM's custom
# all-reduce at decode's sizes), 10 us each.
_GPU_STEP = dict(
    async_launch=True,
    decode_graphs=True,
    kernels_per_layer=12,
    kernel_launch_s=11.8e-6,
    graph_kernel_s=0.95e-6,
    tp_allreduce="one-shot",
    tp_latency_s=10e-6,
)

# One rank = a node of 8 H100 SXM 80GB running TP8 over NVLink (H100 datasheet: FP8 1979,
# BF16 989 dense TFLOP/s, 3.35 TB/s HBM3; NVLink 4: 450 GB/s per direction per GPU).
# Meta's setup: FP8 row-wise weights, BF16 attention and KV, ring pass-KV whose SendRecv
# overlaps attention (comm_overlap 1).
_H100X8 = dict(
    gemm_flops=8 * 1979e12,
    attention_flops=8 * 989e12,
    memory_bandwidth=8 * 3.35e12,
    memory_bytes=8 * 80 * GIB,
    weight_dtype="fp8",
    activation_dtype="bf16",
    gemm_efficiency=0.29,
    attention_efficiency=0.58,
    memory_efficiency=0.80,  # typical share of HBM bandwidth a decode GEMV reaches
    link_efficiency=0.80,  # typical NCCL bus bandwidth over a 400G NIC, ~40 of 50 GB/s
    comm_overlap=1.0,
    ring_step_overhead_s=0.6e-3,
    step_overhead_s=0.0,
    tp_size=8,
    tp_bandwidth=450 * GB,
    **_GPU_STEP,
)

# One rank = 2 H100 SXM 80GB in TP2 over NVLink, FP8 weights, as NVIDIA's NIM benchmarks ran
# Llama-3.3-70B (costmodel/published.py). GEMM efficiency fitted to that table's 5000-token
# TTFT alone (TensorRT-LLM's FP8 GEMMs run nearer their peak than Meta's stack, 0.29 above);
# memory and attention efficiencies as above; every other row of the table is predicted.
_H100X2 = dict(
    _H100X8,
    gemm_flops=2 * 1979e12,
    attention_flops=2 * 989e12,
    memory_bandwidth=2 * 3.35e12,
    memory_bytes=2 * 80 * GIB,
    gemm_efficiency=0.50,
    tp_size=2,
)

# One rank = one core of the 2-core AVX2 development VM (AMD EPYC), fp32, as
# `ctxpar calibrate --threads 1` measured it with two other jobs sharing the cores:
# GEMM 93.5 GFLOP/s, ctxpar's attention 40.0 GFLOP/s, memory read 20.9 GB/s; 2-rank
# all-gather: shm 59 us + 0.38 GB/s, gloo 248 us + 0.29 GB/s.
_CPU_CORE = dict(
    gemm_flops=93.5e9,
    attention_flops=40.0e9,
    memory_bandwidth=20.9e9,
    memory_bytes=24 * GIB,
    weight_dtype="fp32",
    activation_dtype="fp32",
    # ctxpar's paged attention, one thread, rows of 2 tokens: 3.4-5.9 us a row (8-32 rows a call).
    row_overhead_s=5e-6,
)


def _with_lead(rank: HardwareProfile) -> HardwareProfile:
    """``rank`` (one core of the VM) with its lead, the VM's two cores as one rank leading a
    step for the ranks on that host: the rank's rates times what `ctxpar calibrate --threads 1
    --link shm` measured with both cores against one on the quiet VM: GEMM 199.5 / 101.8,
    attention 164.5 / 81.8, memory read 36.3 / 33.5, projection weights 57.8 / 32.1 GB/s
    (the one-core rank streams its projections at its memory rate)."""
    lead = replace(
        rank,
        name=f"{rank.name}-lead",
        description="the host's two AVX2 cores leading a step for the ranks sharing them, fp32",
        gemm_flops=rank.gemm_flops * 1.96,
        attention_flops=rank.attention_flops * 2.01,
        memory_bandwidth=rank.memory_bandwidth * 1.08,
        weight_read_bandwidth=rank.memory_bandwidth * 1.80,
    )
    return replace(rank, lead=lead)


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    "h100x8-ib": HardwareProfile(
        name="h100x8-ib",
        description="a node of 8 H100 SXM (TP8, NVLink), nodes joined by 400 Gb/s-per-GPU RDMA, FP8 weights",
        link_bandwidth=8 * 50 * GB,  # 8 NICs of 400 Gb/s
        link_latency_s=20e-6,
        **_H100X8,  # type: ignore[arg-type]
    ),
    "h100x8-tcp": HardwareProfile(
        name="h100x8-tcp",
        description="as h100x8-ib, nodes joined by 100 Gb/s-per-GPU TCP/IP (Meta's second setup)",
        link_bandwidth=8 * 12.5 * GB,
        link_latency_s=50e-6,
        **_H100X8,  # type: ignore[arg-type]
    ),
    "h100x2-nvlink": HardwareProfile(
        name="h100x2-nvlink",
        description="2 H100 SXM in TP2 over NVLink running a CUDA-graph engine (TensorRT-LLM), FP8 weights",
        link_bandwidth=2 * 50 * GB,  # 2 NICs of 400 Gb/s, for CP between such ranks
        link_latency_s=20e-6,
        **_H100X2,  # type: ignore[arg-type]
    ),
    "cpu-core-shm": _with_lead(
        HardwareProfile(
            name="cpu-core-shm",
            description="one AVX2 core per rank, ranks on one host (ctxpar's shared-memory channel), fp32",
            link_bandwidth=0.38 * GB,
            link_latency_s=59e-6,
            **_CPU_CORE,  # type: ignore[arg-type]
        )
    ),
    "cpu-core-gloo": HardwareProfile(
        name="cpu-core-gloo",
        description="one AVX2 core per rank, ranks joined by gloo over loopback TCP, fp32",
        link_bandwidth=0.29 * GB,
        link_latency_s=248e-6,
        **_CPU_CORE,  # type: ignore[arg-type]
    ),
    "cpu-core-10gbe": HardwareProfile(
        name="cpu-core-10gbe",
        description="one AVX2 core per rank, hosts joined by 10 Gbit/s Ethernet (gloo's measured latency), fp32",
        link_bandwidth=1.25 * GB,
        link_efficiency=0.9,
        link_latency_s=248e-6,
        **_CPU_CORE,  # type: ignore[arg-type]
    ),
}


DEFAULT_PROFILE_FILE = "hardware-profile.json"  # where `ctxpar calibrate` writes by default


def engine_hardware(spec: str | None, one_host: bool) -> HardwareProfile:
    """The profile the engine's PCP policy is derived for: ``spec`` (a built-in name or a
    JSON file), else ./hardware-profile.json (this machine, calibrated) if present, else
    one CPU core's built-in: ranks on one host joined by shared memory, else by gloo."""
    if spec is None and Path(DEFAULT_PROFILE_FILE).is_file():
        spec = DEFAULT_PROFILE_FILE
    return load_hardware(spec or ("cpu-core-shm" if one_host else "cpu-core-gloo"))


def load_hardware(spec: str) -> HardwareProfile:
    """A built-in profile name or a JSON file (as ``ctxpar calibrate`` writes)."""
    if spec in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise CtxparError(
            f"hardware {spec!r} is neither a built-in profile ({', '.join(sorted(BUILTIN_PROFILES))}) nor a JSON file"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CtxparError(f"cannot read hardware profile {path}: {e}") from None
    return profile_from_dict(data, str(path))
