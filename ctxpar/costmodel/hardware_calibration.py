"""Measure this machine for the cost model (`ctxpar calibrate`): one rank's GEMM and
attention FLOP/s, memory read bandwidth, the rates at which its decode step reads
weights (the projection) and its KV cache (the paged decode kernel, on the CPU),
and the collective cost between two local ranks.

Each figure is the best of a few timed repetitions (a shared machine only ever
makes things slower), but for a prefill's rates (GEMM, attention, the elementwise
steps): a prefill runs them back to back for seconds, at their typical speed, so
those are the median of their repetitions (``typical_time``). Collectives are timed between two spawned processes for
a small message (alpha: the latency) and a large one (beta: bytes/s), over
gloo and over ctxpar's shared-memory channel (what ranks on one host use), and
with a shaped ``link`` (1gbit, 10gbit, 100gbit, rdma) over gloo between two
network namespaces joined by that link (ctxpar/costmodel/link_calibration.py).
Last, the host's cost of a step beyond its kernels, once a step and once a layer:
timed through the engine, which sits above the cost model, so the caller passes
that measurement in (``host_overhead``: ctxpar/entrypoints/cli/calibrate_host.py).
For ranks on one host (``link`` "shm") with fewer threads than the host has cores,
the rates again with all of them: the profile's ``lead``, the rank that runs a
step no prompt is split in for every rank sharing the host.

On a GPU (``device="cuda"``) the rank's figures are the GPU's, at sizes that
fill it (each timed call ends in a synchronize); the collectives are still
those of two host processes: NCCL between two GPUs is not measured, so the
link figures stand in for it and the profile's description says so.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ctxpar.checks import machine_memory_bytes, usable_cores
from ctxpar.costmodel.collective_calibration import collective_costs, shaped_link_costs
from ctxpar.costmodel.hardware import CALIBRATED_WEIGHT_DTYPES, DTYPE_BYTES, HardwareProfile
from ctxpar.costmodel.launch_calibration import launch_terms
from ctxpar.costmodel.link_calibration import TIMEOUT_S
from ctxpar.costmodel.models import BUILTIN_MODELS
from ctxpar.costmodel.netns import LINKS
from ctxpar.costmodel.projection_weights import (
    ACTIVATION_DTYPES,
    activation_rows,
    projection_weight,
    quantized_on,
)
from ctxpar.costmodel.rates import Rate, RateKind, Rates
from ctxpar.costmodel.shapes import shape_from_hf_config
from ctxpar.kernels.huge_pages import huge_zeros
from ctxpar.layers.attention.backend import causal_attention
from ctxpar.layers.linear import MLP_ROWS
from ctxpar.layers.weight_arena import release_freed_memory
from ctxpar.machine import cpu_info

# Rows of a prefill chunk the attention's projections (QKV, O) are timed at, and the MLP's: ctxpar
# runs a long prefill's MLP MLP_ROWS rows at a time (LlamaMLP), and so calibrate times it.
PREFILL_ROWS = 1024
# (tokens, in, out) of the projections timed together: a Llama-3.2-1B layer's (QKV, O,
# gate|up, down, as the engine fuses them) at a prefill's rows. One square GEMM
# would not do: Q4_0's integer GEMM ran 950 GOP/s at 1024^3 and 570-820 at the wide and
# long shapes of real layers (2 AMX cores), which a layer's FLOPs then weigh as a prefill does.
GEMM_SHAPES = ((PREFILL_ROWS, 2048, 3072), (PREFILL_ROWS, 2048, 2048), (MLP_ROWS, 2048, 16384), (MLP_ROWS, 8192, 2048))
ATTN_SHAPE = (2048, 32, 64)  # (tokens, heads, head dim): causal, Llama-3.2-1B's layer (8 KV heads)
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int:
    """Bytes of the largest of the CPU's caches as Linux reports them (``caches``: cpu0's
    cache directory in sysfs, each ``index*/size`` such as "491520K"); 0 where none is."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [0]
    for size in caches.glob("index*/size"):
        try:
            text = size.read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)


# Bytes each read rate streams: twice the last-level cache, 256 MB at least, so that a pass finds
# almost none of its bytes still cached, as a decode step streaming a model's weights and KV cache
# through that cache does. (A server CPU's L3 can hold 256 MB: on one of 480 MB, every rate read
# over 256 MB was 8-16% above its rate over 1 or 2 GB, which agree, and a decode step's.)
READ_BYTES = max(256 << 20, 2 * last_level_cache_bytes())
# (context, heads, KV heads, head dim) of the KV read timed: a Llama-3.2-1B layer's cache as a
# decode step reads it, one row of thousands of tokens, over the caches of enough layers to
# hold READ_BYTES, so that every call reads its keys and values from memory, as a step whose
# weights stream between its layers' attention does.
KV_SHAPE = (2048, 32, 8, 64)
# (out, in) of the weights a decode step's projections read: GEMM_SHAPES' layer, so that both
# rates are of the shapes a step multiplies (wide gate|up, long down), not of one matrix.
WEIGHT_SHAPES = tuple((out, inp) for _, inp, out in GEMM_SHAPES)
# (hidden size, its layer's (out, in) weights) of the layers the decode read is timed over on
# the CPU: WEIGHT_SHAPES (Llama-3.2-1B's) and Llama-3-8B's. One width would not do: the Q4_0
# kernel read the 8B's layer (rows of 4096 and 14336 inputs) at 23.7 GB/s and the 1B's (2048 and
# 8192) at 20.7 (2 cores, beyond the L3), and each model's decode step at its own layer's rate.
WEIGHT_LAYERS = ((2048, WEIGHT_SHAPES), (4096, ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))))
# (hidden size, a config of that width) of the layers whose elementwise steps are timed on the CPU,
# at ELEMENTWISE_TOKENS rows (a prefill chunk of the engine's default max_num_batched_tokens):
# Llama-3.2-1B's and Llama-3-8B's, whose widths HardwareProfile.for_model picks between.
ELEMENTWISE_LAYERS = ((2048, BUILTIN_MODELS["llama-3.2-1b"]), (4096, BUILTIN_MODELS["llama-3-8b"]))
ELEMENTWISE_TOKENS = 2048
ELEMENTWISE_RUNS = 5  # timed calls, the median kept (each writes KV into cache pages of its own)
# A GPU's: a Llama-3-8B-sized projection and layer's attention at 8K tokens, and a read
# far beyond its L2 (a few launches' overhead is then noise).
GPU_GEMM_SHAPES = ((8192, 4096, 4096),)
GPU_ATTN_SHAPE = (8192, 32, 128)
GPU_READ_BYTES = 4 << 30
GPU_WEIGHT_SHAPES = ((14336, 4096),)  # Llama-3-8B's MLP up projection: 117 MB in bf16
# (dtype, device, ranks, threads per rank) -> (step_overhead_s, layer_overhead_s): the host's
# cost of a decode step beyond its kernels, for ranks sharing this host whose steps rank 0 leads.
HostOverhead = Callable[[str, torch.device, int, int | None], tuple[float, float]]


BUDGET_S = 1.5  # seconds of repeated calls per figure


def best_time(
    fn: Callable[[], object],
    budget_s: float | None = None,
    min_runs: int = 3,
    device: torch.device | None = None,
    statistic: Callable[[list[float]], float] = min,
) -> float:
    """Fastest of repeated calls within ``budget_s`` (default BUDGET_S; after one warm-up
    call), or another ``statistic`` of their times (``typical_time``: the median); on a GPU
    ``device`` each call is timed to its end (work is queued asynchronously)."""
    if device is not None and device.type == "cuda":
        fn = _synchronized(fn, device)
    fn()
    budget = BUDGET_S if budget_s is None else budget_s
    times: list[float] = []
    t_end = time.perf_counter() + budget
    while len(times) < min_runs or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistic(times)


def typical_time(
    fn: Callable[[], object], budget_s: float | None = None, min_runs: int = 3, device: torch.device | None = None
) -> float:
    """The median of ``best_time``'s calls: what the prefill's rates are timed by. A prefill
    runs seconds of GEMMs and attention back to back, at their typical speed, not at the
    fastest call's: on the 2-core VM the fastest of a 1.5 s sample ran 4-8% above the
    median (Q4_0 GEMM over the 1B's layer 851 against 797 GOP/s, attention 270 against 249
    GFLOP/s), and predicted the engine's prefills that much too fast."""
    return best_time(fn, budget_s, min_runs, device, statistic=statistics.median)


def _synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    def call() -> object:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call


CPU = torch.device("cpu")


def gemm_flops(dtype: str, device: torch.device = CPU, shapes: Sequence[tuple[int, int, int]] | None = None) -> float:
    """FLOP/s of the engine's projection (``ctxpar.layers.linear``) at a prefill's rows, on
    weights of ``dtype`` as loading leaves them (projection_weights.py), over the GEMMs
    ``shapes`` (tokens, in, out) one after another: for q4 the integer GEMM, the activations'
    rounding to int8 included, counted as 2 x tokens x in x out; the median call's rate."""
    from ctxpar.layers.linear import linear

    shapes = shapes or (GPU_GEMM_SHAPES if device.type == "cuda" else GEMM_SHAPES)
    calls = [(activation_rows(dtype, n, k, device), projection_weight(dtype, m, k, device)) for n, k, m in shapes]
    flops = sum(2 * n * k * m for n, k, m in shapes)
    return flops / typical_time(lambda: [linear(a, w) for a, w in calls], device=device)


def attention_flops(dtype: torch.dtype, device: torch.device = CPU, shape: tuple[int, int, int] | None = None) -> float:
    """Causal attention at the cost model's count: pairs * 2 * H * (d_qk + d_v).
    ctxpar's own path (``attention_path``: on the CPU its compiled kernel, in fp32, or in bf16
    on AMX-BF16's tiles where the CPU has them; PyTorch's otherwise)."""
    n, h, d = shape or (GPU_ATTN_SHAPE if device.type == "cuda" else ATTN_SHAPE)
    kv_heads = h // 4  # Llama-3's 8 of 32
    q = torch.randn(n, h, d, dtype=dtype, device=device)
    k, v = (torch.randn(n, kv_heads, d, dtype=dtype, device=device) for _ in range(2))
    pairs = n * (n + 1) / 2
    return pairs * 2 * h * 2 * d / typical_time(lambda: causal_attention(q, k, v, d**-0.5), device=device)


def attention_path(dtype: torch.dtype, device: torch.device = CPU, shape: tuple[int, int, int] | None = None) -> str:
    """Which kernel ``causal_attention`` runs on inputs of ``dtype`` at ``shape`` (ATTN_SHAPE's
    widths): the engine's choice, which ``attention_flops`` times."""
    from ctxpar.layers.attention.backend import kernel_inputs

    _, h, d = shape or (GPU_ATTN_SHAPE if device.type == "cuda" else ATTN_SHAPE)
    q, k = torch.zeros(1, h, d, dtype=dtype, device=device), torch.zeros(1, h // 4, d, dtype=dtype, device=device)
    inputs = kernel_inputs(q, k, k)
    if inputs is None:
        return "PyTorch's"
    if inputs[0].dtype == torch.bfloat16:
        return "the compiled bf16 kernel on AMX tiles"
    return "the compiled fp32 kernel" + (", bf16 widened" if dtype != torch.float32 else "")


def attention_rates(device: torch.device, progress: Callable[[str], None]) -> Rates:
    """Causal attention's FLOP/s (``attention_flops``) in each activation dtype, each through
    the kernel the engine runs for it (bf16 on AMX-BF16's tiles where the CPU has them)
    (HardwareProfile.with_activation_dtype takes them)."""
    rates = []
    for name, dtype in ACTIVATION_DTYPES.items():
        rates.append(Rate("attention_flops", name, attention_flops(dtype, device)))
        progress(f"attention {name} ({attention_path(dtype, device)}): {rates[-1].value / 1e9:.1f} GFLOP/s")
    return Rates.of(rates)


def weight_read_bandwidth(
    dtype: str,
    device: torch.device = CPU,
    nbytes: int | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
) -> float:
    """Bytes/s at which the engine's decode projection reads weights: ``ctxpar.layers.linear``
    on weights of ``dtype`` as loading leaves them (projection_weights.py: the panel kernel
    or the quantized one on the CPU, F.linear on a GPU), one input row each, over copies of
    the (out, in) matrices ``shapes`` enough to hold ``nbytes``, far beyond the caches, so
    every call streams its weight from memory. Bytes counted as the cost model counts them:
    out x in x the dtype's size (DTYPE_BYTES: q4's 18 bytes a block of 32). The matrices are
    large enough that a call's fixed cost (the host's, measured apart) is noise. On the CPU
    they lie in huge pages, as a loaded model's (ctxpar/layers/weight_arena.py)."""
    from ctxpar.layers.linear import linear
    from ctxpar.layers.weight_arena import place_on_huge_pages

    nbytes = nbytes or (GPU_READ_BYTES if device.type == "cuda" else READ_BYTES)
    shapes = shapes or (GPU_WEIGHT_SHAPES if device.type == "cuda" else WEIGHT_SHAPES)
    size = sum(out * inp for out, inp in shapes) * DTYPE_BYTES[dtype]
    copies = max(2, math.ceil(nbytes / size))  # at least two: one call never reads what the last left in cache
    calls = [
        (activation_rows(dtype, 1, inp, device), projection_weight(dtype, out, inp, device, seed=i))
        for i in range(copies)
        for out, inp in shapes
    ]
    holder = torch.nn.Module()
    for i, (_, w) in enumerate(calls):
        setattr(holder, f"w{i}", w)
    place_on_huge_pages(holder)
    return copies * size / best_time(lambda: [linear(x, w) for x, w in calls], device=device)


def layer_gemms(shapes: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, int], ...]:
    """A layer's (out, in) weights (WEIGHT_LAYERS' form: QKV, O, gate|up, down) as the GEMMs
    (tokens, in, out) a prefill runs them at: each at the rows of GEMM_SHAPES' projection of
    its place (the attention's at PREFILL_ROWS, the MLP's at MLP_ROWS), the last's beyond."""
    rows = [n for n, _, _ in GEMM_SHAPES]
    return tuple((rows[min(i, len(rows) - 1)], inp, out) for i, (out, inp) in enumerate(shapes))


def projection_rates(device: torch.device, progress: Callable[[str], None]) -> Rates:
    """Both rates of the projections (``gemm_flops`` at a prefill's rows, ``weight_read_bandwidth``
    at a decode's one) for every weight dtype the engine keeps on ``device``
    (HardwareProfile.with_weight_dtype takes them); on the CPU also both over each of
    WEIGHT_LAYERS (the GEMM at GEMM_SHAPES' rows), by the layer's width (HardwareProfile.for_model
    picks one), the first width's read being the reference read. (The Q4_0 GEMM ran the 8B's
    layer, whose down projection multiplies rows of 14336, ~15% slower than the 1B's at the
    same rows.)"""
    rates: list[Rate] = []
    for dtype in CALIBRATED_WEIGHT_DTYPES:
        if dtype == "q4" and not quantized_on(device):
            continue
        gemm = gemm_flops(dtype, device)
        rates.append(Rate("gemm_flops", dtype, gemm))
        if device.type == "cpu":
            layers = {hidden: layer_gemms(shapes) for hidden, shapes in WEIGHT_LAYERS}
            gemms = {
                hidden: gemm if list(shapes) == list(GEMM_SHAPES) else gemm_flops(dtype, device, shapes)
                for hidden, shapes in layers.items()
            }
            reads = {hidden: weight_read_bandwidth(dtype, device, shapes=shapes) for hidden, shapes in WEIGHT_LAYERS}
            rates += [Rate("gemm_flops", dtype, rate, hidden) for hidden, rate in gemms.items()]
            rates += [Rate("weight_read_bandwidth", dtype, rate, hidden) for hidden, rate in reads.items()]
            read = reads[WEIGHT_LAYERS[0][0]]
            at = lambda rates, unit, scale: ", ".join(
                f"{rate / scale:.1f} {unit} over a {hidden}-wide layer" for hidden, rate in rates.items()
            )
            line = f"GEMM {at(gemms, 'GFLOP/s', 1e9)}, decode's weight read {at(reads, 'GB/s', 1e9)}"
        else:
            read = weight_read_bandwidth(dtype, device)
            line = f"GEMM {gemm / 1e9:.1f} GFLOP/s, decode's weight read {read / 1e9:.1f} GB/s"
        rates.append(Rate("weight_read_bandwidth", dtype, read))
        progress(f"projection, {dtype} weights: {line}")
    return Rates.of(rates)


def kv_read_bandwidth(
    dtype: torch.dtype, nbytes: int | None = None, shape: tuple[int, int, int, int] | None = None
) -> float | None:
    """Bytes/s at which the engine's paged decode kernel (``gqa_paged_decode``) reads a GQA
    KV cache of ``dtype`` (the activation dtype's: the engine's "auto" cache) on the CPU: one
    row of ``shape``'s context (its tokens in consecutive slots, as a fresh engine's blocks)
    per call, over caches of layers enough to hold ``nbytes``, in huge pages as the engine's
    (ctxpar/worker/kv_cache_allocation.py). Bytes counted as the cost model counts them: the
    keys' and values' entries (ModelShape.kv_bytes). None where the kernels do not serve
    such a cache (not built, or disabled)."""
    from ctxpar.kernels.attention_kernels import gqa_paged_decode, usable

    context, heads, kv_heads, dim = shape or KV_SHAPE
    per_layer = context * 2 * kv_heads * dim * dtype.itemsize
    layers = max(2, math.ceil((nbytes or READ_BYTES) / per_layer))  # two at least: a call never finds its keys cached
    caches = huge_zeros((layers, context, 2, kv_heads, dim), dtype)  # touched only below, if used
    if not usable(caches[0], dim):
        return None
    caches.normal_()
    q = torch.randn(1, heads, dim)
    slots, starts = torch.arange(context), torch.tensor([0, context])
    read = lambda: [gqa_paged_decode(q, caches[i], slots, starts, dim**-0.5) for i in range(layers)]
    return layers * per_layer / best_time(read)


def kv_read_rates(progress: Callable[[str], None]) -> Rates:
    """The paged decode kernel's KV read rate (``kv_read_bandwidth``) over the cache of each
    activation dtype; none where the kernels do not serve (a step then reads its cache
    otherwise, at the memory rate)."""
    rates = []
    for name, dtype in ACTIVATION_DTYPES.items():
        rate = kv_read_bandwidth(dtype)
        if rate is not None:
            rates.append(Rate("kv_read_bandwidth", name, rate))
            progress(f"decode's KV read, {name} cache (paged decode kernel): {rate / 1e9:.1f} GB/s")
    return Rates.of(rates)


def elementwise_bandwidth(dtype: torch.dtype, config: dict[str, Any], tokens: int | None = None) -> float:
    """Bytes/s at which the engine's elementwise steps of one decoder layer of the Llama config
    ``config`` move their values (ModelShape.elementwise_bytes) over ``tokens`` rows (default
    ELEMENTWISE_TOKENS) in ``dtype``, each through the engine's own function as a layer calls it
    (ctxpar/models/llama.py; the compiled kernels where they serve): RMSNorm, rope in place in
    the QKV projection's output, the KV entries' write into a cache in huge pages
    (``gather_and_store_kv``), RMSNorm with the residual add before it, SiLU·up over the MLP's
    row chunks (MLP_ROWS rows at a time, as LlamaMLP runs a long prefill), their outputs
    joined, and the residual add after the MLP. Each allocates its output afresh, as in a
    step, from a heap whose free pages went back to the OS before the call (a prefill's
    projections map and unmap outputs of tens to hundreds of MB between these steps, and on a
    VM a page's first write is much of a step's cost); the KV entries go to cache pages
    nothing has touched yet, as a prompt's do in an engine that has not yet cycled through
    its cache (an 8 MB layer's entries took 11.5 ms into fresh huge pages, 0.4 ms into
    touched ones). Those faults vary from call to call, and a prefill pays them as they
    come: the rate is of the median of ELEMENTWISE_RUNS calls, not the fastest. (Timed so,
    a 1B's steps take ~0.35 s of a 2K prefill and an 8B's ~1.8 s; the engine spent ~0.6 and
    ~2.6 s in them, the fastest calls of a warm process ~0.2 and ~0.9.)"""
    from ctxpar.layers.activation import silu_and_mul
    from ctxpar.layers.forward_context import ForwardContext, gather_and_store_kv
    from ctxpar.layers.norm import RMSNorm
    from ctxpar.layers.rotary import apply_rotary_

    n = tokens or ELEMENTWISE_TOKENS
    shape = shape_from_hf_config({**config, "num_hidden_layers": 1}, "a layer")
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    dim = config.get("head_dim") or hidden // heads
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data.fill_(1.0)
    h, a = (torch.randn(n, hidden, dtype=dtype) for _ in range(2))
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, dtype=dtype)
    gate_up = torch.randn(n, 2 * inter, dtype=dtype)
    angles = torch.rand(n, dim // 2) * 6.28
    cos, sin = angles.cos(), angles.sin()
    # One cache of a slice per call (the warm-up's included), each call's entries written into
    # its own slice, pages nothing has touched yet: a prompt's blocks in a fresh engine's cache.
    cache = huge_zeros(((ELEMENTWISE_RUNS + 1) * n, 2, kv_heads, dim), dtype)
    calls = iter(range(ELEMENTWISE_RUNS + 1))

    def layer() -> None:
        norm(h)
        apply_rotary_(qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim), cos, sin)
        slots = torch.arange(n) + next(calls) * n
        ctx = ForwardContext([0, n], [0], [n], [slots], None, slots, [cache])
        gather_and_store_kv(qkv[:, heads * dim :].view(n, 2, kv_heads, dim), ctx, 0)
        norm(a, residual=h)
        if n <= MLP_ROWS:
            silu_and_mul(gate_up)
            mlp = a  # stands for the down projection's output
        else:
            for i in range(0, n, MLP_ROWS):
                silu_and_mul(gate_up[i : i + MLP_ROWS])
            mlp = torch.cat([a[i : i + MLP_ROWS] for i in range(0, n, MLP_ROWS)])  # the chunks' outputs joined
        h.add_(mlp)

    layer()  # warm-up
    times = []
    for _ in range(ELEMENTWISE_RUNS):
        release_freed_memory()  # the heap's free pages back to the OS, as a prefill's churn leaves them
        t0 = time.perf_counter()
        layer()
        times.append(time.perf_counter() - t0)
    return n * shape.elementwise_bytes(dtype.itemsize) / statistics.median(times)


def elementwise_rates(progress: Callable[[str], None]) -> Rates:
    """The elementwise steps' rate (``elementwise_bandwidth``) in each activation dtype over each
    of ELEMENTWISE_LAYERS, by the layer's width (HardwareProfile.for_model picks one), the first
    of which is also the reference rate."""
    rates: list[Rate] = []
    for name, dtype in ACTIVATION_DTYPES.items():
        widths = {hidden: elementwise_bandwidth(dtype, config) for hidden, config in ELEMENTWISE_LAYERS}
        rates += [Rate("elementwise_bandwidth", name, rate, hidden) for hidden, rate in widths.items()]
        rates.append(Rate("elementwise_bandwidth", name, widths[ELEMENTWISE_LAYERS[0][0]]))
        progress(
            f"elementwise steps (norms, rope, SiLU·up, residuals, KV write), {name}: "
            + ", ".join(f"{rate / 1e9:.1f} GB/s over a {hidden}-wide layer" for hidden, rate in widths.items())
        )
    return Rates.of(rates)


def read_bandwidth(device: torch.device = CPU, nbytes: int | None = None) -> float:
    """Bytes/s of a sum over a buffer far beyond the caches (on the CPU in huge pages, as
    the engine's KV caches)."""
    nbytes = nbytes or (GPU_READ_BYTES if device.type == "cuda" else READ_BYTES)
    if device.type == "cpu":
        x = huge_zeros((nbytes // 4,), torch.float32).fill_(1.0)
    else:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / best_time(lambda: x.sum(), device=device)


def calibrate(
    threads: int,
    dtype: str,
    link: str,
    progress: Callable[[str], None],
    host_overhead: HostOverhead,
    device: torch.device = CPU,
    link_timeout_s: float = TIMEOUT_S,
    kernel_count: Callable[[str, torch.device], int] | None = None,
) -> HardwareProfile:
    """Measure and return the profile of one rank running ``threads`` threads with weights
    of ``dtype`` (a key of CALIBRATED_WEIGHT_DTYPES; activations in the dtype it takes) on ``device``
    (the CPU, or one GPU), its link ``link``: "shm", "gloo" (two local
    processes) or a key of ctxpar.costmodel.netns.LINKS (measured within ``link_timeout_s``);
    the host's cost of a step is what ``host_overhead`` measures, the engine's kernels a
    layer what ``kernel_count`` counts (on a GPU; ctxpar/costmodel/launch_calibration.py)."""
    torch.set_num_threads(threads)
    activation = CALIBRATED_WEIGHT_DTYPES[dtype]
    rates = attention_rates(device, progress) | projection_rates(device, progress)
    bandwidth = read_bandwidth(device)
    progress(f"memory read: {bandwidth / 1e9:.1f} GB/s")
    if device.type == "cpu":  # the paged decode kernel and the elementwise kernels are the CPU's
        rates |= kv_read_rates(progress) | elementwise_rates(progress)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the spawned ranks only copy
    costs = collective_costs()
    for name in ("gloo", "shm"):
        if f"{name}_latency_s" in costs:
            progress(
                f"all-gather over {name}, 2 ranks: latency {costs[f'{name}_latency_s'] * 1e6:.0f} us, "
                f"{costs[f'{name}_bandwidth'] / 1e9:.2f} GB/s"
            )
    if link in LINKS:
        costs |= shaped_link_costs(link, link_timeout_s)
        progress(
            f"all-gather over {link} ({LINKS[link][1]}, tc tbf between two network namespaces), 2 ranks: "
            f"latency {costs[f'{link}_latency_s'] * 1e6:.0f} us, {costs[f'{link}_bandwidth'] / 1e9:.3f} GB/s"
        )
    dtypes = tuple(ACTIVATION_DTYPES) if device.type == "cpu" else (activation,)
    rates |= host_costs(host_overhead, dtypes, device, 1, None, lambda line: progress(f"host cost of a {line}"))
    step, layer = _measured(rates, "step_overhead_s", activation), _measured(rates, "layer_overhead_s", activation)
    kernels = kernel_count(activation, device) if kernel_count is not None and device.type == "cuda" else 0
    terms = launch_terms(device, layer, kernels)
    progress("launch terms: " + ", ".join(f"{k} {v:.3g}" for k, v in terms.items()))
    if f"{link}_latency_s" not in costs:
        link = "gloo"
    joined = f"{LINKS[link][1]} (gloo over a veth shaped with tc tbf)" if link in LINKS else link
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device)
        rank = f"one {gpu.name} (torch {torch.__version__})"
        links = f"NCCL not measured; the link figures are {joined} between two host processes"
        memory = float(gpu.total_memory)
    else:
        rank, links = f"one rank of {threads} thread(s) on {cpu_info().model}", f"ranks joined by {joined}"
        memory = float(machine_memory_bytes())
    profile = HardwareProfile(
        name=f"calibrated-{socket.gethostname()}",
        description=f"{rank}, {dtype}, {links} (ctxpar calibrate, {when})",
        gemm_flops=_measured(rates, "gemm_flops", dtype),
        attention_flops=_measured(rates, "attention_flops", activation),
        memory_bandwidth=bandwidth,
        weight_read_bandwidth=_measured(rates, "weight_read_bandwidth", dtype),
        kv_read_bandwidth=rates.get("kv_read_bandwidth", activation) or 0.0,
        elementwise_bandwidth=rates.get("elementwise_bandwidth", activation) or 0.0,
        memory_bytes=memory,
        link_bandwidth=costs[f"{link}_bandwidth"],
        link_latency_s=costs[f"{link}_latency_s"],
        weight_dtype=dtype,
        activation_dtype=activation,
        step_overhead_s=step,
        layer_overhead_s=layer,
        rates=rates,
        notes={"threads": threads, **costs},
    )
    profile = replace(profile, **terms)  # type: ignore[arg-type]
    ranks = usable_cores() // threads
    if link != "shm" or device.type != "cpu" or ranks < 2:
        return profile
    return replace(profile, lead=lead_profile(profile, threads, ranks, progress, host_overhead))


def _measured(rates: Rates, kind: RateKind, dtype: str) -> float:
    """The reference rate of ``kind`` in ``dtype``, which the calibration has just measured."""
    rate = rates.get(kind, dtype)
    assert rate is not None, (kind, dtype)  # every calibration measures it
    return rate


def host_costs(
    host_overhead: HostOverhead,
    dtypes: Sequence[str],
    device: torch.device,
    ranks: int,
    threads: int | None,
    progress: Callable[[str], None],
) -> Rates:
    """The host's cost of a step (``host_overhead``: ranks of ``threads`` threads, rank 0
    leading) with activations of each of ``dtypes``, a step's and a layer's
    (HardwareProfile.with_activation_dtype takes them): on the CPU an fp32 step runs its
    layers in one compiled loop, a bf16 one layer by layer from Python."""
    costs: list[Rate] = []
    for dtype in dtypes:
        step, layer = host_overhead(dtype, device, ranks, threads)
        costs += [Rate("step_overhead_s", dtype, step), Rate("layer_overhead_s", dtype, layer)]
        progress(f"step in {dtype} beyond its kernels: {step * 1e3:.2f} ms + {layer * 1e6:.0f} us a layer")
    return Rates.of(costs)


def lead_profile(
    rank: HardwareProfile, own: int, ranks: int, progress: Callable[[str], None], host_overhead: HostOverhead
) -> HardwareProfile:
    """The step rank 0 leads for ``ranks`` ranks like ``rank`` (of ``own`` threads) sharing
    this host: the rates with all their threads, and the host's cost of such a step, measured
    by ``host_overhead`` through an engine of that many ranks."""
    weight, activation = rank.weight_dtype, rank.activation_dtype
    threads = ranks * own
    torch.set_num_threads(threads)
    try:
        led = lambda line: progress(f"a led step's {line}")
        rates = attention_rates(CPU, led) | projection_rates(CPU, led)
        memory = read_bandwidth()
        rates |= kv_read_rates(led) | elementwise_rates(led)
    finally:
        torch.set_num_threads(own)
    progress(f"a step led for {ranks} ranks, {threads} threads: memory read {memory / 1e9:.1f} GB/s")
    try:
        rates |= host_costs(
            host_overhead,
            tuple(ACTIVATION_DTYPES),
            CPU,
            ranks,
            own,
            lambda line: progress(f"host cost of a led {line}"),
        )
    finally:
        torch.set_num_threads(own)
    return replace(
        rank,
        name=f"{rank.name}-lead",
        description=f"{rank.description}; a step led for {ranks} ranks with {threads} threads",
        gemm_flops=_measured(rates, "gemm_flops", weight),
        attention_flops=_measured(rates, "attention_flops", activation),
        memory_bandwidth=memory,
        weight_read_bandwidth=_measured(rates, "weight_read_bandwidth", weight),
        kv_read_bandwidth=rates.get("kv_read_bandwidth", activation) or 0.0,
        elementwise_bandwidth=rates.get("elementwise_bandwidth", activation) or 0.0,
        step_overhead_s=_measured(rates, "step_overhead_s", activation),
        layer_overhead_s=_measured(rates, "layer_overhead_s", activation),
        rates=rates,
        notes={"threads": threads, "ranks": ranks},
    )
