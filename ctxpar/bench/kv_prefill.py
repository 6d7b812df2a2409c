"""`ctxpar bench kernels --kv-prefill`: one layer's prefill attention over each KV-cache
format, with the steps a quantized cache adds, at SmolLM2-135M's heads (9 query and 3
KV heads of 64) and Llama-3.2-1B's (32 and 8 of 64).

Per shape and prompt length (causal, no cached context): the prefill kernel over int8
rows (kernels/prefill_attention.cpp: integer dot products over the blocks' codes) and
fp8_e4m3 rows (blocks dequantized as reached), over a float32 cache, and over a bf16
one where AMX-BF16 runs it (kernels/prefill_tiles.cpp; elsewhere a bf16 cache widens
to the float32 kernel); then the Walsh-Hadamard turns of
a turned cache (queries, entries and the output: ctxpar/layers/kv_rotation.py) and the
quantizer's write of the entries (kernels/kv_quantize.cpp). The cases run in
interleaved rounds and each prints its median; rates count 4 x head width flops per
visible query-key pair (q·k and p·v). ``--per-core``: one thread, timed by its CPU time.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch

from ctxpar.bench.machine_line import describe_machine, kernel_clock
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers import kv_rotation
from ctxpar.layers.kv_quant import KVQuant, default_runs

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3.2-1B": (32, 8, 64)}  # query heads, KV heads, head width
LENGTHS = (512, 2048)


def _cases(
    n: int, heads: int, kv_heads: int, dim: int, g: torch.Generator
) -> dict[str, tuple[Callable[[], object], bool]]:
    """Each timed step of an n-token prompt's layer: name -> (the call, whether it attends)."""
    shape = (2, kv_heads, dim)
    q, kv = torch.randn(n, heads, dim, generator=g), torch.randn(n, *shape, generator=g)
    cases: dict[str, tuple[Callable[[], object], bool]] = {}
    quants = {name: KVQuant.of(name, shape, default_runs(shape)) for name in ("int8", "fp8_e4m3")}
    for name, quant in quants.items():
        assert quant is not None
        rows = quant.quantize(kv)
        cases[f"{name} rows"] = (partial(attn_kernels.prefill_attention_quant, q, rows, quant, dim**-0.5), True)
    cases["float32 cache"] = (lambda: attn_kernels.prefill_attention(q, kv[:, 0], kv[:, 1], dim**-0.5), True)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    if attn_kernels.prefill_usable(qb, kvb[:, 0], kvb[:, 1]):
        cases["bf16 cache (AMX)"] = (lambda: attn_kernels.prefill_attention(qb, kvb[:, 0], kvb[:, 1], dim**-0.5), True)
    q_scale, kv_scale = kv_rotation.scales(dim)
    out = torch.randn(n, heads, dim, generator=g)
    # In place, as attention turns its inputs, on copies of their own: at these widths a turn is
    # orthonormal (scale = 1 / sqrt(dim)), so the rounds' repeated turns keep the values' size.
    assert q_scale == kv_scale == dim**-0.5
    turned = ((q.clone(), q_scale), (kv.clone(), kv_scale), (out, q_scale))
    cases["turns (q, k|v, out)"] = (lambda: [kv_rotation.turn(x, scale) for x, scale in turned], False)
    int8 = quants["int8"]
    assert int8 is not None
    cases["int8 quantizer"] = (lambda: int8.quantize(kv), False)
    return cases


def run_kv_prefill(args: argparse.Namespace) -> None:
    clock = kernel_clock(args.per_core)
    print(describe_machine())
    print(
        f"{torch.get_num_threads()} thread(s), {'CPU' if args.per_core else 'wall'} time; one layer's causal prefill, "
        f"median of {args.repeat} interleaved rounds"
    )
    g = torch.Generator().manual_seed(0)
    for model, (heads, kv_heads, dim) in SHAPES.items():
        print(f"{model} ({heads}/{kv_heads} heads of {dim})")
        print(f"{'tokens, step':>30} | ms / layer | GFLOP/s")
        for n in LENGTHS:
            cases = _cases(n, heads, kv_heads, dim, g)
            times = _medians(cases, args.repeat, clock)
            flops = 4 * dim * heads * n * (n + 1) / 2
            for name, (_, attends) in cases.items():
                rate = f"{flops / times[name] / 1e9:7.0f}" if attends else ""
                print(f"{f'{n}, {name}':>30} | {times[name] * 1e3:10.3f} | {rate}")


def _medians(
    cases: dict[str, tuple[Callable[[], object], bool]], repeat: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Each case's median time over `repeat` interleaved rounds, after a warm-up call."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn, _ in cases.values():
        fn()
    for _ in range(repeat):
        for name, (fn, _) in cases.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}
