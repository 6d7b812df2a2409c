"""The HTTP server under load versus offline LLM.generate, in one run.

Workload: N prompts of seeded random lengths made of random real token ids,
each generating a fixed number of tokens greedily with EOS ignored, so every
configuration does exactly the same work.

1. Offline baseline (the same engine flags, in this process): the throughput
   of LLM.generate on all N prompts at once, and each prompt's time to first
   token alone (max_tokens=1, one after the other).
2. Served: a `ctxpar serve --no-prefix-caching` process on a free loopback
   port (or --url, a server already running the same model, which should run
   with --no-prefix-caching too: every level sends the same prompts, and a
   cache would serve the later levels from the first). For each concurrency C, C client
   threads send the N prompts as streaming /v1/completions requests, a new
   one as soon as one ends. Printed per C: requests/s, output tok/s, TTFT
   and inter-token latency p50 / p99, and how many requests came out
   token-identical to offline.
3. Ratios: served output tok/s at the best C over offline throughput (goal
   >= 0.9), and offline TTFT p50 over served TTFT p50 at C = 1 (goal: within
   10%, i.e. >= 0.9).

With --max-num-batched-tokens A B ... a server runs per token budget, each level
sent to each in turn (the same load around both): the serving default against
another budget in one run.

With --peer-python (a venv's Python with vLLM's CPU build) the run is ctxpar serve
against vLLM's server under the same load instead, each level --seconds long and
measured in its steady state as guidellm measures it (serve_peer.py; --guidellm-venv
runs guidellm beside each level and prints how its figures and ours agree).

Traffic goes to loopback only, bounded by N requests per level (with --peer-python,
by --seconds) and --timeout.
Offline runs first, then the server, so the two never share the CPU.
"""

from __future__ import annotations

import argparse
import subprocess
import time
import urllib.parse

from ctxpar.bench.llm_readings import first_token_seconds
from ctxpar.bench.server_process import free_port, percentile, start_server, stream_completion, sweep_level
from ctxpar.checks import int_arg, max_threads, nonnegative_int, positive_int
from ctxpar.config import QUANTIZATIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--url", metavar="URL", help="a running server of the same model (default: start one here)")
    p.add_argument("--pcp", type=positive_int, default=1, metavar="P", help="PCP ranks of both engines (default: 1)")
    p.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=[1, 4, 16, 64],
        metavar="C",
        help="client counts of the sweep (default: 1 4 16 64)",
    )
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=64,
        metavar="N",
        help="requests per level; with --peer-python, the prompts sent in turn (default: 64)",
    )
    p.add_argument("--min-prompt-len", type=positive_int, default=64, metavar="N", help="shortest prompt (default: 64)")
    p.add_argument(
        "--max-prompt-len", type=positive_int, default=512, metavar="N", help="longest prompt (default: 512)"
    )
    p.add_argument("--output-len", type=positive_int, default=32, metavar="N", help="tokens per request (default: 32)")
    p.add_argument("--threads", type=int_arg(1, max_threads()), metavar="N", help="torch threads per rank")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the prompts (default: 0)")
    p.add_argument(
        "--peer-python",
        metavar="PY",
        help="Python of a venv with vLLM's CPU build: ctxpar serve against vLLM's server instead of offline",
    )
    p.add_argument("--peer-dtype", default="bfloat16", metavar="T", help="vLLM's --dtype (default: bfloat16)")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="ctxpar's weights (default: none against offline, ctxpar's default against --peer-python)",
    )
    p.add_argument("--guidellm-venv", metavar="DIR", help="with --peer-python: guidellm at each level too")
    p.add_argument(
        "--seconds",
        type=positive_int,
        default=60,
        metavar="S",
        help="with --peer-python: each level's length; its N prompts are sent in turn until then (default: 60)",
    )
    p.add_argument(
        "--warmup",
        type=nonnegative_int,
        default=10,
        metavar="S",
        help="with --peer-python: seconds not measured at a level's start (default: 10)",
    )
    p.add_argument(
        "--cooldown",
        type=nonnegative_int,
        default=5,
        metavar="S",
        help="with --peer-python: seconds not measured at a level's end (default: 5)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        nargs="+",
        metavar="N",
        help="a server per token budget, each level run on each in turn (default: one, serve's default budget)",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=3600,
        metavar="S",
        help="give up on the sweep after S seconds (default: 3600)",
    )


def offline(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]], float, list[float]]:
    """Prompts, offline outputs, offline output tok/s, and each prompt's TTFT alone."""
    from ctxpar import LLM, SamplingParams
    from ctxpar.bench.throughput import llm_prompts

    quantization = args.quantization or "none"
    with LLM(
        args.model, pcp_size=args.pcp, num_threads=args.threads, enable_prefix_caching=False, quantization=quantization
    ) as llm:
        prompts = llm_prompts(llm, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed)
        llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        ttfts = [first_token_seconds(llm.generate({"prompt_token_ids": p}, first, use_tqdm=False)[0]) for p in prompts]
    return prompts, outputs, sum(map(len, outputs)) / elapsed, ttfts


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.errors import CtxparError

    if args.min_prompt_len > args.max_prompt_len:
        raise CtxparError(
            f"need --min-prompt-len <= --max-prompt-len, got {args.min_prompt_len} and {args.max_prompt_len}"
        )
    url = urllib.parse.urlsplit(args.url or "http://127.0.0.1")
    if url.scheme != "http" or url.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise CtxparError(f"--url must be an http:// loopback address (this benchmark sends load), got {args.url!r}")
    if args.url and len(args.max_num_batched_tokens or ()) > 1:
        raise CtxparError("several --max-num-batched-tokens start a server each; drop --url")
    if args.guidellm_venv and not args.peer_python:
        raise CtxparError("--guidellm-venv runs beside --peer-python; pass both")
    if args.peer_python:
        from ctxpar.bench import serve_peer

        if args.url or args.pcp != 1:
            raise CtxparError("--peer-python starts both servers itself on one rank; drop --url and --pcp")
        if args.warmup + args.cooldown >= args.seconds:
            raise CtxparError(
                f"--warmup {args.warmup} + --cooldown {args.cooldown} leave nothing of --seconds {args.seconds} "
                "to measure: lengthen --seconds"
            )
        serve_peer.run(args)
        return
    print(describe_machine())
    prompts, want, off_tps, off_ttft = offline(args)
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.output_len} output tokens each, P={args.pcp}"
    )
    print(f"offline LLM.generate: {off_tps:8.1f} output tok/s; TTFT alone p50 {percentile(off_ttft, 50) * 1e3:.0f} ms")

    budgets: list[int | None] = list(args.max_num_batched_tokens or [None])
    servers: dict[int | None, tuple[int, subprocess.Popen | None]] = {}  # budget -> (port, server started here)
    served: dict[tuple[int, int | None], tuple[float, float]] = {}  # (concurrency, budget) -> (out tok/s, TTFT p50)
    try:
        for b in budgets:
            port = (url.port or 8000) if args.url else free_port()
            extra = ("--no-prefix-caching",) + (("--max-num-batched-tokens", str(b)) if b else ())
            servers[b] = port, None if args.url else start_server(args, port, extra, args.quantization or "none")
        deadline = time.monotonic() + args.timeout
        bodies = [
            {
                "prompt": p,
                "max_tokens": args.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            for p in prompts
        ]
        for port, _ in servers.values():
            stream_completion(url.hostname, port, {**bodies[0], "max_tokens": 2}, timeout=120)  # warm-up
        print(" C  budget  req/s  out tok/s  TTFT p50/p99 ms  ITL p50/p99 ms  identical")
        for c in args.concurrency:
            for b, (port, _) in servers.items():  # interleaved: each budget sees the same load from the others
                timings, t0 = sweep_level(url.hostname, port, bodies, c, deadline)
                elapsed = time.perf_counter() - t0
                n_out = sum(len(t.token_ids) for t in timings)
                ttft = [t.ttft for t in timings]
                itl = [x for t in timings for x in t.itls()]
                same = sum(t.token_ids == w for t, w in zip(timings, want))
                served[c, b] = (n_out / elapsed, percentile(ttft, 50))
                print(
                    f"{c:2d} {b or 'serve':>7} {len(timings) / elapsed:6.2f} {n_out / elapsed:10.1f} "
                    f"{percentile(ttft, 50) * 1e3:7.0f}/{percentile(ttft, 99) * 1e3:<7.0f} "
                    f"{percentile(itl, 50) * 1e3:7.1f}/{percentile(itl, 99) * 1e3:<7.1f} {same:4d}/{len(timings)}",
                    flush=True,
                )
    finally:
        for _, server in servers.values():
            if server is not None:
                server.terminate()
                server.wait(60)
    for b in budgets:
        mine = {c: served[c, b] for c in args.concurrency}
        best = max(mine, key=lambda c: mine[c][0])
        print(
            f"ratios, budget {b or 'serve'} (above 1: served better): throughput served(C={best})/offline "
            f"{mine[best][0] / off_tps:.2f}x"
            + (f", TTFT p50 offline/served(C=1) {percentile(off_ttft, 50) / mine[1][1]:.2f}x" if 1 in mine else "")
        )
