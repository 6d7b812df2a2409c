"""Host-side work per step against the context length: nothing may grow faster than
the tokens (quadratic work belongs to attention alone).

For each context length (default 8K, 32K and 128K cached tokens per request), B
requests (default 8) are prefilled in one step, then ``--steps`` decode steps and
one prefill chunk (``--chunk`` new tokens after the context) are timed through the
real pieces, no model: the scheduler (``schedule`` + ``commit``: admission, block
allocation, prefix-cache registration, the step plan), the PCP layout planner and
this rank's rows, the step's token slots, and the context slots attention reads
(O(context) by nature: the index list of the cached KV). The ratios against the
shortest context say how each part grows: 1x is flat, the length ratio is linear.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from ctxpar.checks import positive_int

PARTS = ("scheduler", "layout", "token slots", "context slots")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument(
        "--contexts", type=positive_int, nargs="+", default=[8192, 32768, 131072], metavar="N", help="cached tokens"
    )
    p.add_argument("--requests", type=positive_int, default=8, metavar="B", help="requests decoding at once (8)")
    p.add_argument("--steps", type=positive_int, default=50, metavar="N", help="decode steps timed (50)")
    p.add_argument("--chunk", type=positive_int, default=2048, metavar="N", help="new tokens of the prefill step")
    p.add_argument("--pcp", type=positive_int, default=2, metavar="P", help="ranks the layout plans for (2)")
    p.add_argument("--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block (16)")


def _timer() -> tuple[dict[str, float], Callable[[str, float], float]]:
    totals = dict.fromkeys(PARTS, 0.0)

    def lap(part: str, since: float) -> float:
        now = time.perf_counter()
        totals[part] += now - since
        return now

    return totals, lap


# The engine's internals on purpose: this times the scheduler, the layout planner and the slot
# arithmetic alone, without a model, which no public call can do.


def _request(index: int, prompt: list[int]):
    from ctxpar import RequestMetrics, SamplingParams
    from ctxpar.engine.request import Request

    return Request(f"r{index}", prompt, SamplingParams(max_tokens=1 << 20), index, RequestMetrics(0.0), None)


def _host_step(scheduler, pcp: int, block_size: int, lap: Callable[[str, float], float]) -> None:
    """One step's host work, timed by part; the step's new tokens are 'sampled' as token 1."""
    from ctxpar.layers.step_description import slots_of
    from ctxpar.parallel.pcp import plan_pcp_layout
    from ctxpar.worker.step_inputs import token_rows_positions, token_slots

    t = time.perf_counter()
    batch = scheduler.schedule()
    t = lap("scheduler", t)
    plan = batch.plan
    layout = plan_pcp_layout(plan.num_scheduled_tokens, plan.num_computed_tokens, plan.is_prefilling, pcp)
    rows = layout.rank_rows(0)
    t = lap("layout", t)
    row, pos = token_rows_positions(plan.num_scheduled_tokens, plan.num_computed_tokens)
    token_slots(plan.block_tables, row, pos, block_size)
    t = lap("token slots", t)
    for r, s in zip(rows.req_idx.tolist(), rows.seq_lens.tolist()):
        slots_of(plan.block_tables[r], np.arange(s), block_size)
    t = lap("context slots", t)
    for req, need in zip(batch.requests, plan.needs_logits):
        if need:
            req.output_token_ids.append(1)
    scheduler.commit(batch)
    lap("scheduler", t)


def _measure(context: int, args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """(decode step, prefill chunk): seconds per step by part."""
    from ctxpar.engine.block_manager import BlockManager
    from ctxpar.engine.scheduler import Scheduler

    b, bs = args.requests, args.block_size
    blocks = b * (context + args.chunk + args.steps + 2 * bs) // bs + b
    scheduler = Scheduler(BlockManager(blocks, bs, True), b, b * (context + args.chunk))
    rng = np.random.default_rng(0)
    requests = [_request(i, rng.integers(0, 32000, context).tolist()) for i in range(b)]
    for r in requests:
        scheduler.add(r)
    _, lap = _timer()
    _host_step(scheduler, args.pcp, bs, lap)  # the prefill of every context: not timed
    decode, lap = _timer()
    for _ in range(args.steps):
        _host_step(scheduler, args.pcp, bs, lap)
    decode = {k: v / args.steps for k, v in decode.items()}
    # One more request: its context is cached (the same prompt as request 0), then a chunk of new tokens.
    fresh = _request(b, requests[0].prompt_token_ids[:context] + list(range(args.chunk)))
    for r in requests:
        scheduler.finish(r)
    scheduler.max_num_batched_tokens = args.chunk
    scheduler.add(fresh)
    prefill, lap = _timer()
    _host_step(scheduler, args.pcp, bs, lap)
    return decode, prefill


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.machine_line import describe_machine

    print(describe_machine(), flush=True)
    print(
        f"{args.requests} requests decoding, P = {args.pcp} layout, block size {args.block_size}; "
        f"prefill: a {args.chunk}-token chunk after a cached context. Microseconds per step (x: vs the first)."
    )
    first: dict[str, dict[str, float]] = {}
    header = " context |   step   | " + " | ".join(f"{p:>20}" for p in PARTS)
    print(header)
    for context in args.contexts:
        decode, prefill = _measure(context, args)
        for name, parts in (("decode", decode), ("prefill", prefill)):
            base = first.setdefault(name, parts)
            cells = [f"{parts[p] * 1e6:>10.0f} ({parts[p] / base[p]:>5.1f}x)" for p in PARTS]
            print(f"{context:>8} | {name:>8} | " + " | ".join(f"{c:>20}" for c in cells), flush=True)
