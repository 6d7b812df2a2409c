"""Decode context parallelism: what sharding the KV cache over the ranks buys
and costs, against the same ranks each holding a full replica (D = 1).

(a) capacity: the tokens a fixed kv_cache_bytes per rank holds at D = 1 and
    D = P (and per GiB of KV per rank, with --kv-cache-dtype's storage), and
    how many long requests fit at once;
(b) decode step time at a long context, batch 1 and batch B, for P = 1,
    P = 2 with D = 1 and P = 2 with D = 2 (for each interleave given), with
    the share of the step spent in collectives. The B requests share one
    prompt through the prefix cache (one prefill instead of B), plus one
    distinct token each; each still attends its whole context;
(c) time to first token of a long prompt at P = 2, D = 2 against D = 1;
(d) the combine's collective patterns on two gloo ranks, at the partials'
    shapes of a decode step and of a split prefill step: all-to-all (what
    ctxpar uses), all-gather of (out, lse), all-gather of lse + all-reduce of out.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ctxpar.checks import positive_int
from ctxpar.config import KV_CACHE_DTYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--context", type=positive_int, default=6144, help="context length in tokens (default: 6144)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8], help="decode batch sizes (default: 1 8)")
    p.add_argument("--steps", type=positive_int, default=8, help="decode steps timed per batch (default: 8)")
    p.add_argument("--repeat", type=positive_int, default=2, help="TTFT runs per setup, the best kept (default: 2)")
    p.add_argument(
        "--interleave",
        type=positive_int,
        nargs="+",
        default=[1, 16],
        help="cp_interleave values at D=2 (default: 1 16)",
    )
    p.add_argument("--kv-cache-mib", type=positive_int, default=1024, help="KV cache per rank (default: 1024)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="KV-cache storage (default: auto)")


def _decode_steps(llm, ids: list[int], batch: int, steps: int) -> tuple[float, float]:
    """Seconds per decode step of ``batch`` requests whose context is ``ids`` plus one
    token each (prefix-cache hit), and the share of it spent in collectives."""
    from ctxpar import SamplingParams

    # ctxpar's Engine stepped directly, and its PCP group's counters: the prefills stay off the
    # clock and each decode step is timed alone, which LLM.generate and its metrics cannot do.
    engine = llm.engine
    group = getattr(engine.executor, "group", None)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(ids + [b], params)
    while any(len(r.output_token_ids) == 0 for r in engine.requests.values()):
        engine.step()  # prefills (the shared prompt once, then one token per request)
    engine.step()  # first all-decode step: warm-up
    c0, t0 = (group.comm_seconds if group else 0.0), time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    comm = ((group.comm_seconds - c0) / steps) if group else 0.0
    while engine.has_unfinished_requests():
        engine.step()
    return dt, comm / dt


def _ttft(llm, vocab: int, n: int, repeat: int, seed: int) -> float:
    """Best time to first token of ``repeat`` fresh random prompts of n tokens (no cache hits)."""
    from ctxpar import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    best = float("inf")
    for _ in range(repeat):
        ids = rng.integers(0, vocab, size=n).tolist()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best


def _patterns_rank(rank: int, port: int, shapes: list[tuple[str, int, int]], model: str | None, secret: bytes):
    """One of two ranks timing the combine patterns (d); rank 0 prints."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # The collectives alone, between two ranks of a PCP group with the model's head shapes:
    # no engine runs these patterns but all-to-all.
    from ctxpar.models.loader import load_model
    from ctxpar.parallel.comm import Launch, PCPGroup

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=60))
    PCPGroup(rank, 2, torch.device("cpu"), store, Launch(secret, spawned=True))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    loaded = load_model(model, torch.float32, torch.device("cpu"))
    heads, dim = loaded.hf_config.num_attention_heads, loaded.model.kv_entry_shape[-1]  # GQA: (2, kv_heads, head_dim)

    def a2a(n: int, T: int) -> None:  # each rank's n local tokens' partials, from each rank
        x = torch.randn(2, n, heads, dim + 1)
        dist.all_to_all_single(torch.empty_like(x), x)

    def ag(n: int, T: int) -> None:  # every token's partials to every rank
        x = torch.randn(T, heads, dim + 1)
        gather(x.new_empty(2 * T, heads, dim + 1), x)

    def ag_ar(n: int, T: int) -> None:  # lse gathered, out scaled and summed
        lse, out = torch.randn(T, heads), torch.randn(T, heads, dim)
        gather(lse.new_empty(2 * T, heads), lse)
        dist.all_reduce(out)

    def timed(pattern, *args) -> float:  # ms per call
        pattern(*args)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            pattern(*args)
        return (time.perf_counter() - t0) / 20 * 1e3

    for label, n, T in shapes:
        times = [timed(p, n, T) for p in (a2a, ag, ag_ar)]
        if rank == 0:
            print(f"{label:>26} | " + " | ".join(f"{t:>8.2f}" for t in times), flush=True)
    dist.destroy_process_group()


def _patterns(batches: list[int], chunk: int, model: str | None) -> None:
    import torch.multiprocessing as mp

    from ctxpar.executor.multiproc import free_port
    from ctxpar.parallel.auth import new_secret

    # A decode step's T = n = batch; a split step's n = T / 2.
    shapes = [(f"decode, batch {b}", b, b) for b in batches] + [(f"split prefill, {chunk} tokens", chunk // 2, chunk)]
    print(
        "\n(d) combine collectives on 2 gloo ranks, ms per layer: all-to-all | all-gather | all-gather lse + all-reduce"
    )
    mp.spawn(_patterns_rank, args=(free_port(), shapes, model, new_secret()), nprocs=2)


def run(args: argparse.Namespace) -> None:
    from ctxpar import LLM
    from ctxpar.worker.kv_cache_allocation import tokens_per_gib

    n = args.context
    common: dict[str, Any] = dict(
        max_model_len=n + args.steps + 8,
        max_num_batched_tokens=2048,
        kv_cache_bytes=args.kv_cache_mib << 20,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization="none",  # the figures of docs/benchmarks.md: a GGUF dequantized
    )
    setups: list[tuple[str, dict[str, Any], bool]] = [
        ("P=1", dict(pcp_size=1), False),
        ("P=2 D=1", dict(pcp_size=2), True),
    ]
    setups += [(f"P=2 D=2 I={i}", dict(pcp_size=2, dcp_size=2, cp_interleave=i), True) for i in args.interleave]
    rows, capacity = {}, {}
    for name, kwargs, ttft in setups:
        with LLM(args.model, **common, **kwargs) as llm:
            e = llm.engine  # the KV blocks and bytes per token the engine sized: not reported publicly
            assert e is not None  # open: inside its with block
            D = e.config.dcp_size
            tokens = e.num_blocks * e.config.block_size * D
            per_request = -(-(n + args.steps + 2) // (e.config.block_size * D))
            per_gib = tokens_per_gib(e.kv_bytes_per_token_per_layer * e.loaded.model.num_kv_layers, D)
            capacity[name] = (tokens, per_gib, e.num_blocks // per_request)
            ids = np.random.default_rng(0).integers(0, e.vocab_size, size=n - 1).tolist()
            decode = {b: _decode_steps(llm, ids, b, args.steps) for b in args.batch}
            first = _ttft(llm, e.vocab_size, n, args.repeat, seed=1) if ttft else None
            rows[name] = (decode, first)
            print(f"measured {name}", flush=True)

    print(f"\n(a) KV capacity at {args.kv_cache_mib} MiB per rank, KV cache {args.kv_cache_dtype}")
    print(f"{'setup':>14} | {'tokens':>9} | {'tokens per GiB per rank':>23} | {f'{n}-token requests at once':>26}")
    for name, (tokens, per_gib, fit) in capacity.items():
        print(f"{name:>14} | {tokens:>9} | {per_gib:>23} | {fit:>26}")

    print(f"\n(b) decode step at a {n}-token context (ms per step; collectives' share)")
    print(f"{'setup':>14} | " + " | ".join(f"{f'batch {b}':>18}" for b in args.batch))
    for name, (decode, _) in rows.items():
        cells = [f"{decode[b][0] * 1e3:>9.1f} ({decode[b][1]:>4.0%})" for b in args.batch]
        print(f"{name:>14} | " + " | ".join(f"{c:>18}" for c in cells))

    base = rows["P=2 D=1"][1]
    assert base is not None  # P=2 D=1 times its first token
    print(f"\n(c) time to first token, {n}-token prompt (best of {args.repeat})")
    for name, (_, first) in rows.items():
        if first is not None:
            print(f"{name:>14} | {first:>7.2f} s | {first / base:>5.2f}x of P=2 D=1")
    _patterns(args.batch, 2048, args.model)
