"""The benchmarks, `ctxpar bench NAME`: each a module with ``add_arguments(parser)``
and ``run(args)``, as the product's commands (ctxpar/entrypoints/cli/main.py).
A module is named for what it measures where the command's name alone would
repeat a product module's (`ctxpar bench serve` is server_load.py, not a second
serve.py).

The ``ctxpar`` command (ctxpar/cli.py) lists them from BENCHMARKS' one-line help
and imports only the one that is run: each needs what the others may not (vLLM,
a GPU, the server's packages). Each import is spelled out in ``_load`` so that
the layering test (tests/architecture/test_layering.py) sees what the
benchmarks import; nothing in the product imports them.
"""

from __future__ import annotations

from types import ModuleType

from ctxpar.entrypoints.cli.main import CommandTable


def _load(name: str) -> ModuleType:
    match name:
        case "bf16":
            from ctxpar.bench import bf16_projections

            return bf16_projections
        case "compare":
            from ctxpar.bench import compare

            return compare
        case "cuda":
            from ctxpar.bench import cuda

            return cuda
        case "dcp":
            from ctxpar.bench import dcp

            return dcp
        case "kernels":
            from ctxpar.bench import kernels

            return kernels
        case "quant":
            from ctxpar.bench import quantized_decode

            return quantized_decode
        case "planner":
            from ctxpar.bench import planner

            return planner
        case "policy":
            from ctxpar.bench import policy_vs_fixed

            return policy_vs_fixed
        case "long":
            from ctxpar.bench import long

            return long
        case "overhead":
            from ctxpar.bench import overhead

            return overhead
        case "links":
            from ctxpar.bench import links

            return links
        case "recovery":
            from ctxpar.bench import recovery_time

            return recovery_time
        case "prefix":
            from ctxpar.bench import prefix

            return prefix
        case "serve":
            from ctxpar.bench import server_load

            return server_load
        case "soak":
            from ctxpar.bench import soak

            return soak
        case "structured":
            from ctxpar.bench import structured

            return structured
        case "spec":
            from ctxpar.bench import spec

            return spec
        case "throughput":
            from ctxpar.bench import throughput

            return throughput
        case "ttft":
            from ctxpar.bench import ttft

            return ttft
        case "sizes":
            from ctxpar.bench import real_sizes

            return real_sizes
    raise KeyError(name)


BENCHMARKS = CommandTable(
    help={
        "bf16": "bf16 projections on AMX's tiles vs the AVX-512 BF16 panel loop vs oneDNN; --e2e: TTFT, decode",
        "compare": "the same workload through ctxpar and vLLM's CPU build, side by side",
        "cuda": "one rank on a GPU: logits and tokens vs transformers, TTFT and decode vs estimate",
        "dcp": "decode context parallelism: KV capacity, decode step and TTFT, D=P vs D=1",
        "kernels": "the compiled attention kernels vs the PyTorch path they replace",
        "quant": "decode with a GGUF kept quantized vs dequantized to fp32 and bf16, as a multiple of its floor",
        "planner": "PCP layout planner: vectorised vs loop baseline",
        "policy": "the automatic PCP policy vs fixed settings: mixed, long and short workloads",
        "long": "exactness at 32K tokens: P ranks and D = P against one rank, SmolLM2's shapes",
        "overhead": "host work per step (scheduler, layout, slots) at 8K-128K cached tokens",
        "links": "P = 2 on two namespaces over tbf-shaped links (1-100 Gbit/s, RDMA) vs one core",
        "recovery": "a SIGKILLed rank: time to recover vs the prefill a restart redoes",
        "prefix": "prefix caching: repeated-prefix TTFT and throughput, on vs off",
        "serve": "the HTTP server under a concurrency sweep vs offline LLM.generate",
        "soak": "the HTTP server under random request mixes and client aborts for a long time",
        "structured": "a batch of JSON-schema requests vs the same batch unconstrained",
        "spec": "speculative decoding (n-gram): decode tokens/s on vs off, copy and free text",
        "throughput": "offline throughput vs transformers",
        "ttft": "time to first token with PCP ranks vs one rank",
        "sizes": "GGUFs of real models' shapes (1B-8B) vs llama.cpp: load cold and warm, peak RSS, TTFT, decode",
    },
    load=_load,
    metavar="BENCHMARK",
)
