"""`ctxpar bench kernels --kv-decode`: the decode attention kernel over the default
int8 KV cache at long context, in GB/s of KV read.

One row (a batch-1 decode step) over 2K, 8K and 16K keys with the head shapes of
SmolLM2-135M (30 layers, 9 query and 3 KV heads of 64) and Llama-3.2-1B (16 layers,
32 and 8 of 64): each layer's cache rows (int8 codes and a float32 scale per K and V
head, 1088 bytes a token for the 1B shape) in 16-token blocks scattered over the pool
as a used pool's are, and one step's attention of every layer in turn, so the caches
stream from memory, not from a cache the previous layer left warm. Prints the best
step's attention time and the bytes it read over it. ``--per-core``: on one thread,
timed by its CPU time (a core's figure whatever else the machine runs).
"""

from __future__ import annotations

import argparse

import torch

from ctxpar.bench.machine_line import describe_machine, kernel_clock
from ctxpar.kernels import attention_kernels as attn_kernels
from ctxpar.layers.kv_quant import KVQuant, default_runs

SHAPES = {"SmolLM2-135M": (30, 9, 3, 64), "Llama-3.2-1B": (16, 32, 8, 64)}  # layers, heads, KV heads, dim
CONTEXTS = (2048, 8192, 16384)
BLOCK = 16  # tokens per KV block (the engine's default block_size)


def _step(layers: int, heads: int, kv_heads: int, dim: int, keys: int, g: torch.Generator):
    """A closure running one decode row's attention over `layers` int8 caches of `keys`
    tokens, and the bytes of KV those caches hold."""
    quant = KVQuant.of("int8", (2, kv_heads, dim), default_runs((2, kv_heads, dim)))
    assert quant is not None
    caches = [quant.quantize(torch.randn(keys, 2, kv_heads, dim, generator=g)) for _ in range(layers)]
    order = torch.randperm(keys // BLOCK, generator=g)
    pos = torch.arange(keys)
    slots = order[pos // BLOCK] * BLOCK + pos % BLOCK
    starts = torch.tensor([0, keys], dtype=torch.int64)
    q = torch.randn(1, heads, dim, generator=g)

    def step() -> None:
        for rows in caches:
            attn_kernels.gqa_paged_decode(q, rows, slots, starts, dim**-0.5, quant)

    return step, sum(c.numel() for c in caches)


def run_kv_decode(args: argparse.Namespace) -> None:
    clock = kernel_clock(args.per_core)
    print(describe_machine())
    print(
        f"{torch.get_num_threads()} thread(s), {'CPU' if args.per_core else 'wall'} time; one decode row's attention "
        f"over every layer's int8 KV cache (blocks of {BLOCK} scattered), best of {args.repeat}"
    )
    print(f"{'shape, keys':>24} | KV MB | attention ms / step | GB/s of KV")
    g = torch.Generator().manual_seed(0)
    for name, (layers, heads, kv_heads, dim) in SHAPES.items():
        for keys in CONTEXTS:
            step, size = _step(layers, heads, kv_heads, dim, keys, g)
            step()  # warm-up
            best = float("inf")
            for _ in range(args.repeat):
                t0 = clock()
                step()
                best = min(best, clock() - t0)
            print(f"{name + ', ' + str(keys):>24} | {size / 1e6:5.0f} | {best * 1e3:18.2f} | {size / best / 1e9:6.1f}")
