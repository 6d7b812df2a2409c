"""`ctxpar bench kernels --kv-prefill`: one layer's prefill attention over each KV-cache
format, with the steps a quantized cache adds, at SmolLM2-135M's heads (9 query and 3
KV heads of 64).

Per prompt length (causal, no cached context): the prefill kernel over int8 and
fp8_e4m3 rows (kernels/prefill_attention.cpp, blocks dequantized as reached), over a
float32 cache, and over a bf16 one where AMX-BF16 runs it (kernels/prefill_tiles.cpp;
elsewhere a bf16 cache widens to the float32 kernel); then the Walsh-Hadamard turns of
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

HEADS, KV_HEADS, DIM = 9, 3, 64
LENGTHS = (512, 2048)


def _cases(n: int, g: torch.Generator) -> dict[str, tuple[Callable[[], object], bool]]:
    """Each timed step of an n-token prompt's layer: name -> (the call, whether it attends)."""
    shape = (2, KV_HEADS, DIM)
    q, kv = torch.randn(n, HEADS, DIM, generator=g), torch.randn(n, *shape, generator=g)
    cases: dict[str, tuple[Callable[[], object], bool]] = {}
    quants = {name: KVQuant.of(name, shape, default_runs(shape)) for name in ("int8", "fp8_e4m3")}
    for name, quant in quants.items():
        assert quant is not None
        rows = quant.quantize(kv)
        cases[f"{name} rows"] = (partial(attn_kernels.prefill_attention_quant, q, rows, quant, DIM**-0.5), True)
    cases["float32 cache"] = (lambda: attn_kernels.prefill_attention(q, kv[:, 0], kv[:, 1], DIM**-0.5), True)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    if attn_kernels.prefill_usable(qb, kvb[:, 0], kvb[:, 1]):
        cases["bf16 cache (AMX)"] = (lambda: attn_kernels.prefill_attention(qb, kvb[:, 0], kvb[:, 1], DIM**-0.5), True)
    q_scale, kv_scale = kv_rotation.scales(DIM)
    out = torch.randn(n, HEADS, DIM, generator=g)
    turned = ((q, q_scale), (kv, kv_scale), (out, q_scale))
    cases["turns (q, k|v, out)"] = (lambda: [kv_rotation.turn(x, scale) for x, scale in turned], False)
    int8 = quants["int8"]
    assert int8 is not None
    cases["int8 quantizer"] = (lambda: int8.quantize(kv), False)
    return cases


def run_kv_prefill(args: argparse.Namespace) -> None:
    clock = kernel_clock(args.per_core)
    print(describe_machine())
    print(
        f"{torch.get_num_threads()} thread(s), {'CPU' if args.per_core else 'wall'} time; one layer's causal prefill "
        f"({HEADS}/{KV_HEADS} heads of {DIM}), median of {args.repeat} interleaved rounds"
    )
    print(f"{'tokens, step':>30} | ms / layer | GFLOP/s")
    g = torch.Generator().manual_seed(0)
    for n in LENGTHS:
        cases = _cases(n, g)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for fn, _ in cases.values():
            fn()  # warm-up
        for _ in range(args.repeat):
            for name, (fn, _) in cases.items():
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
        flops = 4 * DIM * HEADS * n * (n + 1) / 2
        for name, (_, attends) in cases.items():
            t = statistics.median(times[name])
            rate = f"{flops / t / 1e9:7.0f}" if attends else ""
            print(f"{f'{n}, {name}':>30} | {t * 1e3:10.3f} | {rate}")
