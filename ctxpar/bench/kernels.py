"""Time ctxpar's compiled kernels against the PyTorch path they replace.

Both sides run through the layer entry points the model calls
(``gqa_paged_attention`` for decode rows over a paged cache,
``causal_attention`` for prefill chunks; for a Llama layer's elementwise
steps ``RMSNorm`` with and without the residual, ``apply_rotary_`` and
``silu_and_mul``; a layer's four projections through ``linear`` with its
weights ``packed``), once with the kernels and once with
``CTXPAR_KERNELS=0``, at SmolLM2's shapes (9 query and 3 KV heads of 64,
fp32, or bf16 with ``--dtype bfloat16``): so the baseline is exactly what
ctxpar runs without them (batched GEMMs over gathered contexts, PyTorch's flash
kernel, oneDNN's packed weights). Prints the best time of each, the ratio, and
the largest difference between the two outputs; a prefill row also the kernel's
rate in GFLOP/s (4 x head width per visible query-key pair: q·k and p·v).

``--march haswell`` (or another GCC CPU name) builds and times the kernels of
that CPU's code path (AVX2's, AVX-VNNI's with ``alderlake``) on this one.
``--quant`` times instead the block-quantized projections (kernels/quant_gemv.cpp)
at SmolLM2-135M's, Llama-3.2-1B's and Llama-3-8B's widths (``--models``), GGUF blocks read where they lie as a
loaded file's are: per case its GOP/s (2 per multiply-add), their fraction of the
int8 peak measured in the same run (kernels.quant.int8_peak_ops: the dot-product
instructions alone, in registers, on every thread), and the time of the same
product in bf16 through oneDNN (``F.linear``), the runs interleaved. ``--kv-decode``
times instead the decode attention over an int8 KV cache at 2K-16K keys (kv_decode.py),
``--kv-prefill`` a layer's prefill attention over each KV-cache format (kv_prefill.py).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

# The layers' entry points, not the public API: the kernels are what is timed, one at a time.
from ctxpar import kernels
from ctxpar.bench.gguf_shapes import FORMATS, random_blocks
from ctxpar.bench.kv_decode import run_kv_decode
from ctxpar.bench.kv_prefill import run_kv_prefill
from ctxpar.bench.machine_line import describe_machine, kernel_clock
from ctxpar.checks import positive_int
from ctxpar.errors import CtxparError
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.kernels import quant
from ctxpar.kernels.build import MARCH_ENV, target_cpu
from ctxpar.layers.activation import silu_and_mul
from ctxpar.layers.attention.backend import AttentionSpec, causal_attention
from ctxpar.layers.attention.paged import gqa_paged_attention
from ctxpar.layers.forward_context import ForwardContext
from ctxpar.layers.linear import linear, packed
from ctxpar.layers.norm import RMSNorm
from ctxpar.layers.quant_blocks import decode
from ctxpar.layers.quant_linear import QuantWeight, has_fields, quant_linear
from ctxpar.layers.rotary import apply_rotary_

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
DECODE_CASES = ((1, 2048), (16, 16), (16, 100), (16, 1000), (64, 500))  # (rows, keys each)
PREFILL_CASES = ((64, 0), (128, 0), (512, 1536), (2048, 0), (2048, 4096))  # (chunk, cached context)
ELEMENTWISE_TOKENS = (1, 16, 2048)
PROJECTION_CASES = ((1, 30), (16, 30), (64, 30), (2048, 2))  # (tokens, layers): decode streams the model
HIDDEN, INTER = 576, 1536
# A layer's projections (out, in) at real widths: QKV, O, gate|up, down.
QUANT_SHAPES = {
    "SmolLM2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "1B": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
PEAK_ROUNDS = 20_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed calls per case and path (best kept)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="the tensors' dtype (default float32)"
    )
    parser.add_argument("--quant", action="store_true", help="the quantized projections at 1B-8B widths instead")
    parser.add_argument(
        "--kv-decode", action="store_true", help="the decode attention over an int8 KV cache at 2K-16K keys instead"
    )
    parser.add_argument(
        "--kv-prefill", action="store_true", help="a layer's prefill attention over each KV-cache format instead"
    )
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[16, 512, 2048], help="--quant: token rows")
    parser.add_argument(
        "--formats", nargs="+", choices=["Q4_0", "Q8_0", "Q6_K"], default=["Q4_0"], help="--quant: blocks"
    )
    parser.add_argument(
        "--models", nargs="+", choices=list(QUANT_SHAPES), default=list(QUANT_SHAPES), help="--quant: whose widths"
    )
    parser.add_argument(
        "--per-core",
        action="store_true",
        help="--quant, --kv-decode, --kv-prefill: one thread, timed by its CPU time (a core's figures)",
    )
    parser.add_argument(
        "--march",
        help="build the kernels for this GCC CPU name instead of this CPU (haswell: the AVX2 path, "
        "alderlake: AVX-VNNI's), to time another CPU's code path on this one",
    )


def _best(fn: Callable[[], torch.Tensor], kernel: bool, repeat: int) -> tuple[float, torch.Tensor]:
    """Best seconds of `repeat` calls with the kernels on or off, and the output."""
    os.environ["CTXPAR_KERNELS"] = "1" if kernel else "0"
    out, best = fn(), float("inf")  # the first call warms up
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _compare(label: str, fn: Callable[[], torch.Tensor], repeat: int, flops: float = 0.0) -> None:
    """One row: both paths' best times, their ratio, the outputs' largest difference,
    and the kernel's GFLOP/s where `flops` is given."""
    t_kernel, out = _best(fn, True, repeat)
    t_torch, want = _best(fn, False, repeat)
    diff = (out.float() - want.float()).abs().max().item()
    rate = f" | {flops / t_kernel / 1e9:7.3g}" if flops else ""
    print(f"{label:>32} | {t_kernel * 1e3:9.3f} | {t_torch * 1e3:9.3f} | {t_kernel / t_torch:6.2f}x | {diff:.1e}{rate}")


def _decode_step(rows: int, keys: int, g: torch.Generator, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One layer's attention of `rows` one-query rows with `keys` keys each, their
    blocks scattered over the cache like a used pool's."""
    blocks_per_row = -(-keys // BLOCK)
    num_blocks = rows * blocks_per_row
    cache = torch.randn(num_blocks * BLOCK, 2, KV_HEADS, DIM, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).view(rows, blocks_per_row)
    pos = torch.arange(keys)
    slots = [order[r][pos // BLOCK] * BLOCK + pos % BLOCK for r in range(rows)]
    q = torch.randn(rows, HEADS, DIM, generator=g).to(dtype)

    def step() -> torch.Tensor:
        ctx = ForwardContext(  # a fresh one per call: nothing memoised from the other path
            query_start_loc=list(range(rows + 1)),
            start_pos=[keys - 1] * rows,
            seq_lens=[keys] * rows,
            prompt_lens=[keys - 1] * rows,  # each query a generated token's: the decode path
            context_slots=slots,
            write_src=None,
            write_slots=torch.empty(0, dtype=torch.int64),
            kv_caches=[cache],
        )
        return gqa_paged_attention(q, cache, ctx, AttentionSpec(DIM**-0.5))

    return step


def _elementwise_steps(n: int, g: torch.Generator, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """A Llama layer's elementwise steps on n tokens (SmolLM2's widths): the input
    RMSNorm, rope of Q and K inside the QKV projection, the residual add with
    the post-attention RMSNorm, SiLU·up. The in-place steps work on fresh
    copies of their inputs (copied on both paths alike)."""
    norm = RMSNorm(HIDDEN, 1e-5)
    norm.weight.data = torch.randn(HIDDEN, generator=g).to(dtype)
    x, h = torch.randn(n, HIDDEN, generator=g).to(dtype), torch.randn(n, HIDDEN, generator=g).to(dtype)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(dtype)
    gate_up = torch.randn(n, 2 * INTER, generator=g).to(dtype)
    angles = torch.rand(n, DIM // 2, generator=g) * n
    cos, sin = angles.cos(), angles.sin()

    def step() -> torch.Tensor:
        qk = qkv.clone()[:, : (HEADS + KV_HEADS) * DIM].view(n, HEADS + KV_HEADS, DIM)
        residual = h.clone()
        outs = [norm(x), apply_rotary_(qk, cos, sin), norm(x, residual=residual), silu_and_mul(gate_up.clone())]
        return torch.cat([o.reshape(n, -1) for o in outs], dim=1)

    return step


def _projections(n: int, layers: int, g: torch.Generator, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """The four projections (QKV, O, gate|up, down) of `layers` Llama layers on n
    tokens, the weights packed as the loader packs them with the kernels on or
    off. Decode cases take SmolLM2's 30 layers: 425 MB of weights, streamed from
    memory as in a real step, not from the cache."""
    shapes = (((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), (HIDDEN, HEADS * DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER))
    weights = [(torch.randn(shape, generator=g) / shape[1] ** 0.5).to(dtype) for _ in range(layers) for shape in shapes]
    xs = [torch.randn(n, shape[1], generator=g).to(dtype) for shape in shapes]
    cache: dict[bool, list] = {}

    def step() -> torch.Tensor:
        path = kernels.enabled()
        if path not in cache:  # packed on the path's first (warm-up) call; one path's copy at a time
            cache.clear()
            cache[path] = [packed(w) for w in weights]
        outs = [linear(x, w) for x, w in zip(xs * layers, cache[path])]
        return torch.cat(outs[-4:], dim=1)  # the last layer's: compared between the paths

    return step


def _int8_peak(clock: Callable[[], float]) -> float:
    """GOP/s of the int8 dot-product instructions alone on every thread, now."""
    t0 = clock()
    ops = quant.int8_peak_ops(PEAK_ROUNDS)
    return ops / (clock() - t0) / 1e9


def _quant_projections(args: argparse.Namespace) -> None:
    """Each shape and row count: the quantized product's best time, GOP/s and fraction
    of the int8 peak measured just before and after it (the better of the two: other
    jobs slow both alike), against oneDNN's bf16 product of the same shape, the two
    interleaved. --per-core: on one thread, each timed by the thread's CPU time."""
    if quant.int8_peak_ops(1) == 0:
        raise CtxparError("this CPU has no int8 dot products (AVX2 or wider): nothing to measure against")
    for fmt in args.formats:
        block = FORMATS[fmt][0]
        if bad := [m for m in args.models if any(cols % block for _, cols in QUANT_SHAPES[m].values())]:
            raise CtxparError(f"{fmt}'s blocks of {block} weights do not divide {' '.join(bad)}'s widths; drop them")
    clock = kernel_clock(args.per_core)
    rng, peaks = np.random.default_rng(0), [_int8_peak(clock)]
    print(f"{'rows x (out, in)':>38} |  int8 ms | GOP/s | of peak |  bf16 ms | bf16 / int8 time")
    for fmt in args.formats:
        for model in args.models:
            for name, (out, cols) in QUANT_SHAPES[model].items():
                raw = random_blocks(fmt, out, cols, rng)
                # Q6_K is decoded to 8-bit codes in groups of 16, as a GGUF's loader does.
                w = (
                    QuantWeight.in_place(raw, fmt)
                    if has_fields(fmt, cols)
                    else QuantWeight.from_decoded(decode(raw, fmt, cols))
                )
                w_bf16 = torch.randn(out, cols, dtype=torch.bfloat16)
                for n in args.rows:
                    x = torch.randn(n, cols)
                    x_bf16 = x.bfloat16()
                    best = {"int8": float("inf"), "bf16": float("inf")}
                    runs = {"int8": lambda: quant_linear(x, w), "bf16": lambda: F.linear(x_bf16, w_bf16)}
                    for fn in runs.values():  # warm-up
                        fn()
                    for _ in range(args.repeat):
                        for key, fn in runs.items():
                            t0 = clock()
                            fn()
                            best[key] = min(best[key], clock() - t0)
                    peaks.append(_int8_peak(clock))
                    rate = 2 * n * out * cols / best["int8"] / 1e9
                    label = f"{fmt} {model} {name} {n} x ({out}, {cols})"
                    print(
                        f"{label:>38} | {best['int8'] * 1e3:8.2f} | {rate:5.0f} | {rate / max(peaks[-2:]):6.0%} | "
                        f"{best['bf16'] * 1e3:8.2f} | {best['bf16'] / best['int8']:.2f}x"
                    )
    print(
        f"int8 peak: {max(peaks):.0f} GOP/s on {torch.get_num_threads()} threads (best of {len(peaks)} runs, "
        f"{min(peaks):.0f} the least){', CPU time' if args.per_core else ''}"
    )


def run(args: argparse.Namespace) -> None:
    if args.march:  # before the library's first load, which builds it for the target named here
        os.environ[MARCH_ENV] = args.march
    if args.kv_decode or args.kv_prefill or args.quant:
        if not kernels.available():
            raise CtxparError("ctxpar's kernels are not available here (CTXPAR_KERNELS=0, or no C++ compiler)")
        if args.kv_decode:
            run_kv_decode(args)
            return
        if args.kv_prefill:
            run_kv_prefill(args)
            return
        print(f"{describe_machine()}; kernels built for -march={target_cpu()}")
        _quant_projections(args)
        return
    if not attn_kernels.usable(torch.zeros(1, 2, 1, 8), 8):
        raise CtxparError(
            "ctxpar's kernels are not available here (CTXPAR_KERNELS=0, or no C++ compiler): "
            "nothing to compare; unset CTXPAR_KERNELS or install g++"
        )
    dtype = getattr(torch, args.dtype)
    print(describe_machine())
    print(
        f"{torch.get_num_threads()} threads; one layer's attention ({HEADS}/{KV_HEADS} heads of {DIM}) and "
        f"elementwise steps (hidden {HIDDEN}, intermediate {INTER}), {args.dtype}"
    )
    g = torch.Generator().manual_seed(0)
    saved = os.environ.get("CTXPAR_KERNELS")
    try:
        print(f"{'decode: rows x keys':>32} | kernel ms | torch ms |  ratio | max |diff|")
        for rows, keys in DECODE_CASES:
            _compare(f"{rows} x {keys}", _decode_step(rows, keys, g, dtype), args.repeat)
        print(f"{'prefill: chunk after context':>32} | kernel ms | torch ms |  ratio | max |diff| | GFLOP/s")
        for chunk, context in PREFILL_CASES:
            q = torch.randn(chunk, HEADS, DIM, generator=g).to(dtype)
            kv = torch.randn(context + chunk, 2, KV_HEADS, DIM, generator=g).to(dtype)
            pairs = chunk * context + chunk * (chunk + 1) / 2  # query-key pairs a causal chunk sees
            _compare(
                f"{chunk} after {context}",
                lambda: causal_attention(q, kv[:, 0], kv[:, 1], DIM**-0.5),
                args.repeat,
                flops=4 * DIM * HEADS * pairs,
            )
        print(f"{'elementwise: tokens':>32} | kernel ms | torch ms |  ratio | max |diff|")
        for n in ELEMENTWISE_TOKENS:
            _compare(f"{n}", _elementwise_steps(n, g, dtype), args.repeat)
        print(f"{'projections: tokens':>32} | kernel ms | torch ms |  ratio | max |diff|")
        for n, layers in PROJECTION_CASES:
            _compare(f"{n} x {layers} layers", _projections(n, layers, g, dtype), args.repeat)
    finally:
        if saved is None:
            os.environ.pop("CTXPAR_KERNELS", None)
        else:
            os.environ["CTXPAR_KERNELS"] = saved
