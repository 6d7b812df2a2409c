"""Predict TTFT, decode step and memory per rank for every context-parallel
layout (P PCP ranks, D DCP ranks, pass-KV / pass-Q / gather) of one request
shape on given hardware, and recommend the fastest that fits in memory.

The model is a built-in name (llama-3.2-1b, qwen3-1.7b, llama-3-8b, llama-3-70b,
llama-3-405b, qwen3-32b, deepseek-v3, smollm2-135m), a config.json, or a .gguf file:
its shape from the file's metadata, and its weights priced as the engine keeps them
(Q4_0 blocks: q4, at the rates the profile measured for q4: one `ctxpar calibrate`
serves every weight dtype); the hardware a built-in profile (h100x8-ib, h100x8-tcp,
cpu-*) or a JSON profile from `ctxpar calibrate`, whose activation dtype ``--dtype``
changes as the engine's does (bf16: attention at the rate calibrate measured on AMX's
tiles where the CPU has them).
The formulas are in ctxpar/costmodel/timing.py; docs/scaling.md shows what they
predict and how far they were off where measured.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from ctxpar.checks import nonnegative_int, positive_int
from ctxpar.config import KV_CACHE_DTYPES
from ctxpar.costmodel import (
    DEFAULT_OUTPUT_TOKENS,
    Estimate,
    ModelShape,
    estimate,
    load_hardware,
    load_model_shape,
)
from ctxpar.costmodel.shapes import shape_of
from ctxpar.errors import CtxparError

# A GGUF's weight format -> the profile's weight dtype that prices it. The engine keeps
# Q4_0 blocks as they are (18 bytes a block of 32: q4's 0.5625 a weight); formats it
# widens or decodes at load (Q4_K's scales, the 5- and 6-bit ones) read other bytes
# than any dtype here, so they are refused rather than mispriced.
GGUF_WEIGHT_DTYPES = {"Q4_0": "q4", "BF16": "bf16", "F32": "fp32"}
# The engine's --dtype -> the profile's activation dtype that prices it.
COMPUTE_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="built-in model name, a config.json / model directory, or a .gguf file (its weights' "
        "format sets the weight dtype: Q4_0 is q4)",
    )
    p.add_argument("--hardware", required=True, help="built-in profile name or a profile JSON file")
    p.add_argument("--context", type=positive_int, required=True, help="prompt tokens in all, cached ones included")
    p.add_argument("--cached", type=nonnegative_int, default=0, help="prompt tokens already in the KV cache")
    p.add_argument("--batch", type=positive_int, default=1, help="requests of this shape at once")
    p.add_argument("--pcp", type=positive_int, nargs="+", help="PCP sizes to consider (default: 1 2 4 8 16)")
    p.add_argument("--dcp", type=positive_int, nargs="+", help="DCP sizes to consider, 1 or P (default: both)")
    p.add_argument(
        "--output-tokens",
        type=nonnegative_int,
        default=DEFAULT_OUTPUT_TOKENS,
        help="answer length the recommendation optimises for: least TTFT + N decode steps "
        f"(default {DEFAULT_OUTPUT_TOKENS}; 0: TTFT alone)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's dtype, as the engine's --kv-cache-dtype (default: the profile's, "
        "normally auto: the activation dtype); int8 / fp8 store a byte a value and a scale per head",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(COMPUTE_DTYPES),
        help="the engine's compute dtype, as its --dtype: activations, attention (bf16 on AMX tiles where "
        "calibrate found them) and an auto KV cache priced at the profile's rates for it, and the weights "
        "too unless quantized (default: the profile's activation dtype)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per layout")
    p.add_argument(
        "--plot",
        metavar="FILE.svg",
        help="instead, write an SVG of TTFT against context (8K, 16K, ... up to --context), one line per "
        "P, with the published measurements of the model on the hardware as points",
    )


def _row(e: Estimate) -> str:
    t = e.ttft
    mark = "<- recommended" if e.recommended else ("" if e.fits else "does not fit")
    return (
        f"{e.pcp:>3} {e.dcp:>3} {e.algorithm:>8} | {e.ttft_s:>10.3f} {t.compute_s:>8.3f} {t.memory_s:>7.3f} "
        f"{t.tp_comm_s:>7.3f} {t.comm_s:>7.3f} {t.overhead_s:>8.3f} | "
        f"{e.decode_ms:>9.2f} {1e3 * e.decode.comm_s:>7.2f} | "
        f"{e.memory_gib_per_rank:>9.1f} {e.kv_bytes / 2**30:>8.1f}  {mark}"
    )


def gguf_model(path: Path) -> tuple[ModelShape, str]:
    """The shape of the GGUF file ``path`` (from its metadata, as the engine reads it) and
    the weight dtype of its projections: the format holding most of its matrices' weights."""
    from ctxpar.models.gguf import config_from_gguf, open_gguf

    reader = open_gguf(path)
    shape = shape_of(config_from_gguf(reader, path), path.name)
    weights: Counter[str] = Counter()
    for t in reader.tensors:
        if len(t.shape) == 2:
            weights[t.kind.name] += t.shape[0] * t.shape[1]
    fmt = weights.most_common(1)[0][0] if weights else "none"
    if fmt not in GGUF_WEIGHT_DTYPES:
        raise CtxparError(
            f"GGUF file {path}: weights in {fmt}, which the cost model has no dtype for "
            f"(it prices {', '.join(GGUF_WEIGHT_DTYPES)})"
        )
    return shape, GGUF_WEIGHT_DTYPES[fmt]


def run(args: argparse.Namespace) -> None:
    from ctxpar.models.gguf import is_gguf

    hardware = load_hardware(args.hardware)
    if Path(args.model).is_file() and is_gguf(Path(args.model)):
        model, weights = gguf_model(Path(args.model))
        hardware = hardware.with_weight_dtype(weights)
    else:
        model = load_model_shape(args.model)
    if args.dtype is not None:
        compute = COMPUTE_DTYPES[args.dtype]
        if hardware.weight_dtype in COMPUTE_DTYPES.values():  # unquantized weights are in the compute dtype
            hardware = hardware.with_weight_dtype(compute)
        hardware = hardware.with_activation_dtype(compute)
    if args.kv_cache_dtype is not None:
        hardware = hardware.with_kv_cache_dtype(args.kv_cache_dtype)
    if args.plot:
        from ctxpar.costmodel.plot import predicted, published_points, svg

        contexts = [8192 << k for k in range(max(1, (args.context // 8192).bit_length()))]
        lines = predicted(model, hardware, contexts, args.pcp or [1, 2, 4, 8, 16])
        title = f"{model.name} on {hardware.name}: predicted TTFT, batch 1, full prefill"
        Path(args.plot).write_text(svg(title, lines, published_points(model, hardware)))
        print(f"wrote {args.plot}: {len(contexts)} contexts from 8K to {contexts[-1] // 1024}K")
        return
    results = estimate(model, hardware, args.context, args.cached, args.batch, args.pcp, args.dcp, args.output_tokens)
    if args.json:
        print(json.dumps([e.to_dict() for e in results], indent=1))
        return
    print(
        f"model {model.name}: {model.total_params / 1e9:.1f}B parameters, {hardware.weight_dtype} weights, "
        f"{hardware.activation_dtype} activations; "
        f"hardware {hardware.name}: {hardware.description}"
    )
    print(
        f"context {args.context} tokens ({args.cached} cached), batch {args.batch}, KV cache {hardware.kv_cache_dtype}"
    )
    print(
        "  P   D     algo |   TTFT (s)  compute  memory TP comm CP comm overhead | decode ms CP comm | "
        "GiB/rank   KV GiB"
    )
    for e in results:
        print(_row(e))
    if not any(e.recommended for e in results):
        need = min(e.memory_gib_per_rank for e in results)
        have = hardware.usable_memory_fraction * hardware.memory_bytes / 2**30
        print(f"nothing fits: the smallest layout needs {need:.1f} GiB per rank, {have:.1f} GiB usable")
