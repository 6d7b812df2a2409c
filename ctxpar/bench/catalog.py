"""The benchmarks, `ctxpar bench NAME`: each a module with ``add_arguments(parser)``
and ``run(args)``, as the product's commands (ctxpar/entrypoints/cli/main.py).
A module is named for what it measures where the command's name alone would
repeat a product module's (`ctxpar bench serve` is server_load.py, not a second
serve.py).

The ``ctxpar`` command (ctxpar/cli.py) lists them from BENCHMARKS' one-line help
and imports only the one that is run: each needs what the others may not (vLLM,
a GPU, the server's packages). Each import is spelled out, in the function that
loads its benchmark, so that the layering test (tests/architecture/test_layering.py)
sees what the benchmarks import; nothing in the product imports them.
"""

from __future__ import annotations

from types import ModuleType

from ctxpar.entrypoints.cli.main import Command, CommandTable


def _bf16_projections() -> ModuleType:
    from ctxpar.bench import bf16_projections

    return bf16_projections


def _clients() -> ModuleType:
    from ctxpar.bench import clients

    return clients


def _cold_start() -> ModuleType:
    from ctxpar.bench import cold_start

    return cold_start


def _compare() -> ModuleType:
    from ctxpar.bench import compare

    return compare


def _cuda() -> ModuleType:
    from ctxpar.bench import cuda

    return cuda


def _dcp() -> ModuleType:
    from ctxpar.bench import dcp

    return dcp


def _kernels() -> ModuleType:
    from ctxpar.bench import kernels

    return kernels


def _quantized_decode() -> ModuleType:
    from ctxpar.bench import quantized_decode

    return quantized_decode


def _planner() -> ModuleType:
    from ctxpar.bench import planner

    return planner


def _policy_vs_fixed() -> ModuleType:
    from ctxpar.bench import policy_vs_fixed

    return policy_vs_fixed


def _long() -> ModuleType:
    from ctxpar.bench import long

    return long


def _overhead() -> ModuleType:
    from ctxpar.bench import overhead

    return overhead


def _links() -> ModuleType:
    from ctxpar.bench import links

    return links


def _recovery_time() -> ModuleType:
    from ctxpar.bench import recovery_time

    return recovery_time


def _prefix() -> ModuleType:
    from ctxpar.bench import prefix

    return prefix


def _server_load() -> ModuleType:
    from ctxpar.bench import server_load

    return server_load


def _soak() -> ModuleType:
    from ctxpar.bench import soak

    return soak


def _structured() -> ModuleType:
    from ctxpar.bench import structured

    return structured


def _spec() -> ModuleType:
    from ctxpar.bench import spec

    return spec


def _throughput() -> ModuleType:
    from ctxpar.bench import throughput

    return throughput


def _ttft() -> ModuleType:
    from ctxpar.bench import ttft

    return ttft


def _real_sizes() -> ModuleType:
    from ctxpar.bench import real_sizes

    return real_sizes


BENCHMARKS = CommandTable(
    {
        "bf16": Command(
            "bf16 projections on AMX's tiles vs the AVX-512 BF16 panel loop vs oneDNN; --e2e: TTFT, decode",
            _bf16_projections,
        ),
        "clients": Command(
            "lm-eval and guidellm, unmodified, against the server; lm-eval's scores vs offline", _clients
        ),
        "cold": Command(
            "process start to first token of a GGUF out of the page cache: ctxpar generate vs llama.cpp", _cold_start
        ),
        "compare": Command("the same workload through ctxpar and vLLM's CPU build, side by side", _compare),
        "cuda": Command("one rank on a GPU: logits and tokens vs transformers, TTFT and decode vs estimate", _cuda),
        "dcp": Command("decode context parallelism: KV capacity, decode step and TTFT, D=P vs D=1", _dcp),
        "kernels": Command("the compiled attention kernels vs the PyTorch path they replace", _kernels),
        "quant": Command(
            "decode with a GGUF kept quantized vs dequantized to fp32 and bf16, as a multiple of its floor",
            _quantized_decode,
        ),
        "planner": Command("PCP layout planner: vectorised vs loop baseline", _planner),
        "policy": Command(
            "the automatic PCP policy vs fixed settings: mixed, long and short workloads", _policy_vs_fixed
        ),
        "long": Command("exactness at 32K tokens: P ranks and D = P against one rank, SmolLM2's shapes", _long),
        "overhead": Command("host work per step (scheduler, layout, slots) at 8K-128K cached tokens", _overhead),
        "links": Command("P = 2 on two namespaces over tbf-shaped links (1-100 Gbit/s, RDMA) vs one core", _links),
        "recovery": Command("a SIGKILLed rank: time to recover vs the prefill a restart redoes", _recovery_time),
        "prefix": Command("prefix caching: repeated-prefix TTFT and throughput, on vs off", _prefix),
        "serve": Command("the HTTP server under a concurrency sweep vs offline generate or vLLM serving", _server_load),
        "soak": Command("the HTTP server under random request mixes and client aborts for a long time", _soak),
        "structured": Command("a batch of JSON-schema requests vs the same batch unconstrained", _structured),
        "spec": Command("speculative decoding (n-gram): decode tokens/s on vs off, copy and free text", _spec),
        "throughput": Command("offline throughput vs transformers", _throughput),
        "ttft": Command("time to first token with PCP ranks vs one rank", _ttft),
        "sizes": Command(
            "GGUFs of real models' shapes (1B-8B) vs llama.cpp: load cold and warm, peak RSS, TTFT, decode", _real_sizes
        ),
    },
    metavar="BENCHMARK",
)
