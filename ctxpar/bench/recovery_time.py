"""What a lost rank costs: the time from a SIGKILLed rank to the next step done,
against the prefill a restarted engine would redo (the baseline, measured in the
same run).

For each KV layout (--dcp: 1 = every rank holds the whole cache, so a respawned
rank gets a copy of rank 0's blocks; P = sharded, so the lost shard is recomputed
from the tokens), R requests of N prompt tokens are prefilled (timed: the
baseline), a few decode steps are timed, then rank 1 is killed between steps
and the next step, which finds the loss, respawns the rank, restores its KV and
runs again, is timed. Recovery = that step minus a decode step. Most of it is
the new rank importing torch and loading the model; the restore is the rest.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ctxpar.bench.llm_readings import vocab_size
from ctxpar.checks import int_arg, max_threads, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--pcp", type=int_arg(2, 8), default=2, metavar="P", help="PCP ranks (default: 2)")
    p.add_argument("--dcp", type=positive_int, nargs="+", metavar="D", help="KV layouts: 1 and/or P (default: both)")
    p.add_argument("--context", type=positive_int, default=4096, metavar="N", help="prompt tokens (default: 4096)")
    p.add_argument("--requests", type=positive_int, default=2, metavar="R", help="requests in flight (default: 2)")
    p.add_argument("--threads", type=int_arg(1, max_threads()), metavar="N", help="torch threads per rank")
    p.add_argument("--cp-interleave", type=positive_int, default=1, metavar="I", help="DCP shard granularity (1)")
    p.add_argument("--decode-steps", type=positive_int, default=4, metavar="N", help="decode steps timed (4)")


def _measure(args: argparse.Namespace, dcp: int) -> dict[str, float]:
    from ctxpar import LLM, SamplingParams
    from ctxpar.executor.multiproc import MultiRankExecutor

    kw: dict = {"quantization": "none"}  # a GGUF dequantized, as in docs/benchmarks.md
    if args.threads:
        kw["num_threads"] = args.threads
    if dcp > 1:
        kw["cp_interleave"] = args.cp_interleave
    with LLM(args.model, pcp_size=args.pcp, dcp_size=dcp, max_model_len=args.context + 64, **kw) as llm:
        # LLMEngine steps (vLLM's API) so that the prefill and the decode steps are timed apart;
        # the scheduler's queues tell when every prefill is done, and the executor which
        # process is rank 1, to be killed: neither is public.
        engine, core = llm.llm_engine, llm.engine
        assert engine is not None and core is not None  # open: inside its with block
        assert isinstance(core.executor, MultiRankExecutor)  # pcp_size > 1: one process per rank
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=args.decode_steps + 8, temperature=0, ignore_eos=True)
        engine.add_request("warm-up", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        vocab = vocab_size(llm)
        for i in range(args.requests):
            engine.add_request(str(i), {"prompt_token_ids": rng.integers(0, vocab, args.context).tolist()}, params)
        t0 = time.perf_counter()
        while core.scheduler.waiting or not all(r.output_token_ids for r in core.scheduler.running):
            engine.step()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            engine.step()
        step = (time.perf_counter() - t0) / args.decode_steps
        victim = core.executor.procs[0]
        victim.kill()  # SIGKILL
        victim.join(10)
        t0 = time.perf_counter()
        engine.step()
        recovery = time.perf_counter() - t0 - step
        while engine.has_unfinished_requests():
            engine.step()
        rec = core.recovery
        assert rec.recoveries == 1, "the kill was not recovered"
        restored = rec.copied_tokens + rec.recomputed_tokens
        return {"prefill": prefill, "step": step, "recovery": recovery, "restored": restored}


def run(args: argparse.Namespace) -> None:
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.errors import CtxparError

    layouts = args.dcp or [1, args.pcp]
    if any(d not in (1, args.pcp) for d in layouts):
        raise CtxparError(f"--dcp takes 1 or the --pcp value {args.pcp}, got {layouts}")
    print(describe_machine())
    print(f"P = {args.pcp}, {args.requests} request(s) of {args.context} prompt tokens in flight, rank 1 SIGKILLed")
    print("  D  restored KV tokens        recovery s  decode step s  prefill s (baseline)  recovery / prefill")
    for d in layouts:
        m = _measure(args, d)
        how = "copied" if d == 1 else "recomputed"
        print(
            f"{d:3d}  {m['restored']:8.0f} {how:<14} {m['recovery']:10.2f}  {m['step']:13.3f}  "
            f"{m['prefill']:20.2f}  {m['recovery'] / m['prefill']:18.2f}x",
            flush=True,
        )
