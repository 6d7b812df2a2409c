"""Decode with a GGUF's weights kept quantized (quantization="gguf") against the
same file dequantized to fp32 and to bf16, and quantized at load to int8
(quantization="int8", as any safetensors model can be), on the real
SmolLM2-135M Q4_1 GGUF.

A decode step reads every weight once (and the KV cache of its context), so
its floor is those bytes over the memory bus's read bandwidth. For each
setup: ms per decode step (batch 1) after 16 and after 2048 tokens of
context, the bytes a step reads (the projections and the lm_head as held,
plus the KV cache of the context), and the step as a multiple of its floor,
at the measured read bandwidth and at a nominal 18 GB/s. Then the
projections alone (every layer's and the lm_head, one token, timed outside
the engine) against the floor of the weights' bytes: the part of a step that
the weights' format decides; the rest of a step (attention, norms, the
engine's host work) is the same for every format.

``--kv-cache-dtypes model int8 fp8`` runs each setup with each KV-cache storage
(ctxpar/layers/kv_quant.py), one engine each, their runs interleaved, and adds
each step's ratio to the same weights' first storage (default: model, the
unquantized cache; "auto" is what the engine picks for the setup, EngineConfig):
after 2048 tokens the KV cache is the part of a step's bytes that quantizing it
shrinks.
``--perplexity N`` adds each engine's perplexity of N tokens of real English and
real code through ``prompt_logprobs`` (ctxpar/bench/perplexity.py), against the
same weights with the first storage: what quantizing the KV cache costs in quality.
``--eager`` also runs every engine with ``enforce_eager=True`` (each decode step
through the model's Python forward instead of the compiled decode loop,
ctxpar/models/compiled_decode.py), interleaved with it, and adds each step's
ratio to that eager step: what the Python between the kernels costs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from ctxpar.bench.machine_line import describe_machine
from ctxpar.bench.perplexity import perplexity_texts, prompt_perplexity
from ctxpar.checks import positive_int
from ctxpar.config import KV_CACHE_DTYPES
from ctxpar.entrypoints.cli.calibrate_host import decode_step_seconds

SETUPS: dict[str, dict[str, Any]] = {
    "gguf": dict(quantization="gguf"),
    "int8": dict(quantization="int8", dtype="float32"),
    "fp32": dict(quantization="none", dtype="float32"),
    "bf16": dict(quantization="none", dtype="bfloat16"),
}
NOMINAL_BANDWIDTH = 18e9  # bytes/s: issue 25's nominal figure for these machines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument(
        "--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS), help="what to measure (default: all)"
    )
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[16, 2048], help="tokens before the timed steps")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps timed per context (default: 16)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs per context, the best kept (default: 3)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=["model"],
        help="KV-cache storages, each setup with each (default: model); the first is the ratios' baseline",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="also time each engine with enforce_eager=True (no compiled decode loop) and print the ratio",
    )
    p.add_argument(
        "--perplexity",
        type=positive_int,
        default=None,
        metavar="N",
        help="also the perplexity of N tokens of English and of code, per setup and KV storage (default: skip)",
    )


def weight_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads: every projection and the lm_head
    (as the model holds them: packed, quantized or plain), not the embedding
    rows it looks up."""
    from ctxpar.layers.linear import PanelWeight
    from ctxpar.layers.quant_linear import QuantParts, QuantWeight

    def size(w: Any) -> int:
        if isinstance(w, (QuantWeight, QuantParts)):
            return w.nbytes()
        t = w.data if isinstance(w, PanelWeight) else w
        return t.numel() * t.element_size()

    total = size(model.logits_weight())
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        total += sum(size(w) for w in (a.qkv_weight, a.o_weight, m.gate_up_weight, m.down_weight))
    return total


def projection_seconds(model: Any, repeat: int = 20) -> float:
    """Best seconds of one token through every projection and the lm_head, each
    layer's own weights (so they stream from memory, as in a decode step)."""
    import torch

    from ctxpar.layers.linear import linear

    weights = [model.logits_weight()]
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [a.qkv_weight, a.o_weight, m.gate_up_weight, m.down_weight]
    dtype = model.norm.weight.dtype
    xs = [torch.randn(1, _in_features(w), dtype=dtype) for w in weights]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x, w in zip(xs, weights):
            linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best


def _in_features(w: Any) -> int:
    import torch

    from ctxpar.layers.linear import PanelWeight
    from ctxpar.layers.quant_linear import QuantParts, QuantWeight

    if isinstance(w, (QuantWeight, QuantParts)):
        return w.in_features
    if isinstance(w, PanelWeight):  # bf16 panels hold the columns in pairs
        return w.data.shape[1] * (2 if w.data.dtype == torch.bfloat16 else 1)
    return int(w.shape[1])  # a plain or oneDNN-packed weight: (out, in)


def run(args: argparse.Namespace) -> None:
    import contextlib

    import torch

    from ctxpar import LLM
    from ctxpar.costmodel.hardware_calibration import read_bandwidth

    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(describe_machine())
    print(f"memory read bandwidth (torch sum over 256 MiB, best of several): {bandwidth / 1e9:.1f} GB/s")
    rows, projections, quality = [], [], []
    kvs = args.kv_cache_dtypes
    longest = max(max(args.contexts) + args.steps, args.perplexity or 0)
    for name in args.setups:
        kwargs = dict(SETUPS[name], max_model_len=longest + 8, num_threads=args.threads)
        with contextlib.ExitStack() as stack:
            # One engine per KV storage, open together: their runs interleave, so a change
            # of the machine's load between runs reaches every storage alike.
            llms = {kv: stack.enter_context(LLM(args.model, kv_cache_dtype=kv, **kwargs)) for kv in kvs}
            eager = {
                kv: stack.enter_context(LLM(args.model, kv_cache_dtype=kv, enforce_eager=True, **kwargs))
                for kv in (kvs if args.eager else [])
            }
            # The loaded model's projections (their bytes, and one timed alone) and the engine's KV
            # bytes per token: what the floor of a step is computed from, which nothing public reports.
            first_engine = llms[kvs[0]].engine
            assert first_engine is not None  # open: inside the stack
            model = first_engine.loaded.model
            weights = weight_bytes(model)
            projections.append((name, projection_seconds(model), weights))
            for context in args.contexts:
                best = {kv: (float("inf"), float("inf")) for kv in kvs}  # (s/step, prefill s)
                best_eager = {kv: float("inf") for kv in eager}
                for r in range(args.repeat):
                    for kv in kvs:
                        seconds, prefill = decode_step_seconds(llms[kv], context, args.steps, seed=r)
                        best[kv] = (min(best[kv][0], seconds), min(best[kv][1], prefill))
                        if kv in eager:
                            seconds = decode_step_seconds(eager[kv], context, args.steps, seed=r)[0]
                            best_eager[kv] = min(best_eager[kv], seconds)
                for kv in kvs:
                    engine = llms[kv].engine
                    assert engine is not None  # open: inside the stack
                    read = weights + engine.kv_bytes_per_token_per_layer * model.num_kv_layers * (
                        context + args.steps // 2
                    )
                    ratio = best[kv][0] / best[kvs[0]][0]
                    vs_eager = best[kv][0] / best_eager[kv] if kv in eager else None
                    rows.append((name, kv, context, best[kv][0], ratio, vs_eager, weights, read, best[kv][1]))
                print(f"measured {name} after {context} tokens", flush=True)
            if args.perplexity:
                texts = perplexity_texts(llms[kvs[0]].get_tokenizer(), args.perplexity)
                ppl = {kv: {t: prompt_perplexity(llms[kv], ids) for t, ids in texts.items()} for kv in kvs}
                quality += [(name, kv, t, ppl[kv][t], ppl[kv][t] / ppl[kvs[0]][t]) for kv in kvs for t in texts]
    print(f"\ndecode, batch 1, ms per step (best of {args.repeat} runs of {args.steps} steps)")
    first = f"x KV {args.kv_cache_dtypes[0]}"
    header = f"{'weights':>7} | {'KV':>8} | {'context':>7} | {'ms/step':>8} | {first:>9} | {'weights MB':>10} | "
    header += f"{'read MB':>8} | {'floor ms (measured BW)':>22} | {'x floor':>7} | {'floor ms (18 GB/s)':>18} | "
    print(header + f"{'x floor':>7} | {'prefill s':>9}" + (f" | {'x eager':>7}" if args.eager else ""))
    for name, kv, context, seconds, ratio, vs_eager, weights, read, prefill in rows:
        floor, nominal = read / bandwidth, read / NOMINAL_BANDWIDTH
        print(
            f"{name:>7} | {kv:>8} | {context:>7} | {seconds * 1e3:>8.2f} | {ratio:>9.2f} | {weights / 1e6:>10.1f} | "
            f"{read / 1e6:>8.1f} | {floor * 1e3:>22.2f} | {seconds / floor:>7.2f} | {nominal * 1e3:>18.2f} | "
            f"{seconds / nominal:>7.2f} | {prefill:>9.2f}" + (f" | {vs_eager:>7.2f}" if vs_eager is not None else "")
        )
    print("\nprojections and lm_head alone, one token (best of 20)")
    print(
        f"{'weights':>7} | {'ms':>7} | {'weights MB':>10} | {'x floor (measured BW)':>21} | {'x floor (18 GB/s)':>17}"
    )
    for name, seconds, weights in projections:
        print(
            f"{name:>7} | {seconds * 1e3:>7.2f} | {weights / 1e6:>10.1f} | {seconds * bandwidth / weights:>21.2f} | "
            f"{seconds * NOMINAL_BANDWIDTH / weights:>17.2f}"
        )
    if quality:
        print(f"\nperplexity of {args.perplexity} tokens through prompt_logprobs (ctxpar/bench/perplexity.py)")
        print(f"{'weights':>7} | {'KV':>8} | {'text':>7} | {'perplexity':>10} | {first:>9}")
        for name, kv, text, value, ratio in quality:
            print(f"{name:>7} | {kv:>8} | {text:>7} | {value:>10.4f} | {ratio:>9.4f}")
