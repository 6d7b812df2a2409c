"""Time to first token of long single prompts: P=2 context-parallel ranks
(one thread each) against one rank with one thread and with two threads.

Scaling efficiency = T(P=1, 1 thread) / (2 * T(P=2)): 100% means two ranks
halve the prefill. Also prints the share of the P=2 prefill spent in
collectives (waiting for the other rank included) and the time of a
decode-only step: on one host rank 0 leads it with both ranks' threads (then
broadcasts its KV), so its baseline is one rank with two threads; across
hosts PCP replicates the row and skips every collective.

Then, for short prompts at P=2, splitting them across the ranks against
replicating them (what pcp_min_tokens decides): below the crossover the
per-layer all-gathers cost more than the halved compute saves.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ctxpar.bench.llm_readings import collective_seconds, vocab_size
from ctxpar.checks import nonnegative_int, positive_int

# Prefix caching off: the repeats of one prompt would time a cache hit, not a prefill. A GGUF
# dequantized: the path the cost model's fp32 profiles and docs/benchmarks.md's figures are of.
EXACT: dict[str, Any] = dict(enable_prefix_caching=False, quantization="none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[4096, 8128], help="prompt lengths in tokens")
    p.add_argument("--repeat", type=positive_int, default=2, help="timed runs per length (the best is kept)")
    p.add_argument("--decode-steps", type=positive_int, default=16, help="decode steps timed per configuration")
    p.add_argument("--pcp-min-tokens", type=nonnegative_int, default=None, help="override pcp_min_tokens at P=2")
    p.add_argument(
        "--short",
        type=positive_int,
        nargs="*",
        default=[16, 32, 64, 128, 256, 512],
        help="short prompt lengths for the split-vs-replicate table (none: skip it)",
    )


def _prompts(lengths: list[int], vocab: int, seed: int) -> dict[int, list[int]]:
    """The same random prompts for every setup of a table."""
    rng = np.random.default_rng(seed)
    return {n: rng.integers(0, vocab, size=n).tolist() for n in sorted(lengths)}


def _first_token(llm, ids: list[int], repeat: int) -> tuple[float, float]:
    """Best time of `repeat` one-token generations, and the seconds that run spent in collectives."""
    from ctxpar import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    best, comm = float("inf"), 0.0
    for _ in range(repeat):
        c0 = collective_seconds(llm)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        dt = time.perf_counter() - t0
        if dt < best:
            best, comm = dt, collective_seconds(llm) - c0
    return best, comm


def _measure(llm, prompts: dict[int, list[int]], repeat: int, decode_steps: int) -> dict:
    from ctxpar import SamplingParams

    _first_token(llm, prompts[min(prompts)][:256], 1)  # warm up
    result: dict = {}
    for n, ids in prompts.items():
        best, comm = _first_token(llm, ids, repeat)
        result[n] = (best, comm / best)
    short = prompts[min(prompts)][:64]
    t_first, _ = _first_token(llm, short, 1)
    b0 = collective_seconds(llm, "control")
    t0 = time.perf_counter()
    decode = SamplingParams(max_tokens=1 + decode_steps, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": short}], decode, use_tqdm=False)
    result["decode"] = (time.perf_counter() - t0 - t_first) / decode_steps
    result["broadcast"] = (collective_seconds(llm, "control") - b0) / (decode_steps + 1)
    return result


def _short_prompts(args: argparse.Namespace) -> None:
    """TTFT at P=2 of short prompts, split (pcp_min_tokens=0) vs replicated."""
    from ctxpar import LLM

    times = {}
    for mode, min_tokens in (("split", 0), ("replicated", 1 << 30)):
        with LLM(args.model, pcp_size=2, num_threads=1, pcp_min_tokens=min_tokens, **EXACT) as llm:
            prompts = _prompts(args.short, vocab_size(llm), seed=1)
            _first_token(llm, prompts[min(prompts)], 1)  # warm up
            for n, ids in prompts.items():
                times[mode, n] = _first_token(llm, ids, max(3, args.repeat))[0]
    print(
        f"\nshort prompts at P=2: {'prompt':>6} | {'split (ms)':>10} | {'replicated (ms)':>15} | {'split speed-up':>14}"
    )
    for n in args.short:
        s, r = times["split", n], times["replicated", n]
        print(f"{'':>21} {n:>6} | {s * 1e3:>10.1f} | {r * 1e3:>15.1f} | {r / s:>13.2f}x")


def run(args: argparse.Namespace) -> None:
    from ctxpar import LLM

    longest = max(args.lengths)
    common = dict(max_num_batched_tokens=longest, max_model_len=longest + args.decode_steps + 8, **EXACT)
    setups: list[tuple[str, dict[str, Any]]] = [
        ("P=1, 1 thread", dict(pcp_size=1, num_threads=1)),
        ("P=1, 2 threads", dict(pcp_size=1, num_threads=2)),
        ("P=2, 1 thread/rank", dict(pcp_size=2, num_threads=1)),
    ]
    if args.pcp_min_tokens is not None:
        setups[2][1]["pcp_min_tokens"] = args.pcp_min_tokens
    results = {}
    for name, kwargs in setups:
        with LLM(args.model, **common, **kwargs) as llm:
            prompts = _prompts(args.lengths, vocab_size(llm), seed=0)
            results[name] = _measure(llm, prompts, args.repeat, args.decode_steps)
            print(f"measured {name}", flush=True)
    base, two, pcp = (results[name] for name, _ in setups)
    print(
        f"\n{'prompt':>8} | {'P=1 1t (s)':>10} | {'P=1 2t (s)':>10} | {'P=2 (s)':>8} | "
        f"{'speed-up vs 1t':>14} | {'vs 2t':>6} | {'efficiency':>10} | {'collectives':>11}"
    )
    for n in sorted(args.lengths):
        t1, t2, tp = base[n][0], two[n][0], pcp[n][0]
        print(
            f"{n:>8} | {t1:>10.2f} | {t2:>10.2f} | {tp:>8.2f} | {t1 / tp:>13.2f}x | {t2 / tp:>5.2f}x | "
            f"{t1 / (2 * tp):>9.0%} | {pcp[n][1]:>10.0%}"
        )
    print(
        f"\ndecode-only step (64-token context): P=1 1t {base['decode'] * 1e3:.1f} ms, "
        f"P=1 2t {two['decode'] * 1e3:.1f} ms, P=2 {pcp['decode'] * 1e3:.1f} ms "
        f"(P=2 / P=1 2t = {pcp['decode'] / two['decode']:.2f}x; plan broadcast {pcp['broadcast'] * 1e3:.2f} ms/step)"
    )
    if args.short:
        _short_prompts(args)
