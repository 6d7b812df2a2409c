"""Automatic prefix caching: the same workloads with caching on and off, in one run.

1. Document questions: one document (default 6,000 tokens) asked N different
   short questions one after another, each prompt being the document followed
   by the question. Printed per P: the mean time to first token of questions
   2..N with caching and without, and their ratio. Question 1 computes the
   document in both modes; after it, caching computes only the question.
2. Shared system prompt (at the first P only): R requests submitted at once,
   each a shared prefix (default 1,024 tokens) plus its own 100-300 tokens,
   generating a fixed number of tokens. Printed: output tokens/s and total
   time with caching and without, and their ratio.

Prompts are seeded random real token ids; generation is greedy with EOS
ignored, so both modes do the same work and must produce the same tokens
(the benchmark counts the requests that do). Each engine is fresh: its cache
starts empty.
"""

from __future__ import annotations

import argparse
import time

from ctxpar.bench.llm_readings import first_token_seconds
from ctxpar.checks import int_arg, max_threads, nonnegative_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--pcp", type=positive_int, nargs="+", default=[1, 2], metavar="P", help="PCP sizes (default: 1 2)")
    p.add_argument("--doc-tokens", type=positive_int, default=6000, metavar="N", help="document length (default: 6000)")
    p.add_argument(
        "--questions", type=positive_int, default=8, metavar="N", help="questions asked in turn (default: 8)"
    )
    p.add_argument(
        "--question-tokens", type=positive_int, default=24, metavar="N", help="tokens per question (default: 24)"
    )
    p.add_argument("--answer-tokens", type=positive_int, default=8, metavar="N", help="tokens per answer (default: 8)")
    p.add_argument(
        "--requests",
        type=nonnegative_int,
        default=16,
        metavar="N",
        help="shared-prefix requests (default: 16, 0: skip)",
    )
    p.add_argument(
        "--shared-tokens", type=positive_int, default=1024, metavar="N", help="shared prefix (default: 1024)"
    )
    p.add_argument(
        "--own-tokens",
        type=positive_int,
        nargs=2,
        default=[100, 300],
        metavar=("MIN", "MAX"),
        help="range of each request's own tokens (default: 100 300)",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=32,
        metavar="N",
        help="tokens per shared-prefix request (default: 32)",
    )
    p.add_argument(
        "--threads", type=int_arg(1, max_threads()), metavar="N", help="torch threads per rank (default: cores / ranks)"
    )
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the prompts (default: 0)")


def _documents(llm, args: argparse.Namespace) -> list[list[int]]:
    from ctxpar.bench.throughput import llm_prompts

    [doc] = llm_prompts(llm, 1, args.doc_tokens, args.doc_tokens, args.seed)
    qs = llm_prompts(llm, args.questions, args.question_tokens, args.question_tokens, args.seed + 1)
    return [doc + q for q in qs]


def _warm_up(llm, args: argparse.Namespace) -> None:
    """One short unrelated request, so that no mode pays first-call costs."""
    from ctxpar import SamplingParams
    from ctxpar.bench.throughput import llm_prompts

    [p] = llm_prompts(llm, 1, 40, 40, args.seed + 4)
    llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)


def _shared(llm, args: argparse.Namespace) -> list[list[int]]:
    from ctxpar.bench.throughput import llm_prompts

    [shared] = llm_prompts(llm, 1, args.shared_tokens, args.shared_tokens, args.seed + 2)
    lo, hi = args.own_tokens
    own = llm_prompts(llm, args.requests, lo, hi, args.seed + 3)
    return [shared + o for o in own]


def _ask_in_turn(llm, prompts: list[list[int]], answer_tokens: int) -> tuple[list[float], list[list[int]], list[int]]:
    """One request at a time: TTFTs, answers and cached-token counts."""
    from ctxpar import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True)
    ttft, answers, cached = [], [], []
    for p in prompts:
        [out] = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)
        ttft.append(first_token_seconds(out))
        answers.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    return ttft, answers, cached


Batch = tuple[float, list[list[int]]]  # elapsed seconds, outputs


def _batch(llm, prompts: list[list[int]], output_len: int) -> Batch:
    """All at once: elapsed seconds and outputs."""
    from ctxpar import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def _validate(args: argparse.Namespace) -> None:
    from ctxpar.errors import CtxparError

    if args.questions < 2:
        raise CtxparError(f"--questions must be >= 2 (question 1 fills the cache), got {args.questions}")
    for name in ("doc_tokens", "question_tokens", "answer_tokens", "shared_tokens", "output_len"):
        if getattr(args, name) < 1:
            raise CtxparError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.requests < 0 or not 1 <= args.own_tokens[0] <= args.own_tokens[1]:
        raise CtxparError(f"need --requests >= 0 and 1 <= MIN <= MAX for --own-tokens, got {args.own_tokens}")
    if any(p < 1 for p in args.pcp):
        raise CtxparError(f"--pcp sizes must be >= 1, got {args.pcp}")


def run(args: argparse.Namespace) -> None:
    from ctxpar import LLM
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.entrypoints.cli.generate import prefix_cache_summary

    _validate(args)
    longest = args.doc_tokens + args.question_tokens + args.answer_tokens
    longest = max(longest, args.shared_tokens + args.own_tokens[1] + args.output_len)
    print(describe_machine())
    print(
        f"document {args.doc_tokens} tokens, {args.questions} questions of {args.question_tokens} tokens, "
        f"{args.answer_tokens}-token answers; {args.requests} requests of {args.shared_tokens} shared + "
        f"{args.own_tokens[0]}-{args.own_tokens[1]} own tokens, {args.output_len} output tokens each",
        flush=True,
    )
    doc_rows = []
    shared_row: tuple[int, Batch, Batch] | None = None  # P, and the shared prompts' batch with caching off, on
    for pcp in args.pcp:
        result = {}
        for caching in (False, True):
            with LLM(
                args.model,
                pcp_size=pcp,
                num_threads=args.threads,
                max_model_len=longest + 8,
                enable_prefix_caching=caching,
                quantization="none",  # a GGUF dequantized, as in docs/benchmarks.md
            ) as llm:
                _warm_up(llm, args)
                ttft, answers, cached = _ask_in_turn(llm, _documents(llm, args), args.answer_tokens)
                shared = None
                if args.requests and pcp == args.pcp[0]:
                    shared = _batch(llm, _shared(llm, args), args.output_len)
                summary = prefix_cache_summary(llm.engine)
            result[caching] = (ttft, answers, cached, shared)
            print(f"measured P={pcp}, caching {'on' if caching else 'off'}: {summary}", flush=True)
        (t_off, a_off, _, s_off), (t_on, a_on, c_on, s_on) = result[False], result[True]
        later_off, later_on = sum(t_off[1:]) / len(t_off[1:]), sum(t_on[1:]) / len(t_on[1:])
        same = sum(a == b for a, b in zip(a_off, a_on))
        doc_rows.append((pcp, t_off[0], t_on[0], later_off, later_on, sum(c_on[1:]) // len(c_on[1:]), same))
        if s_off is not None and s_on is not None:  # measured at the first P, both ways
            shared_row = (pcp, s_off, s_on)

    n = args.questions
    print(f"\ndocument questions: time to first token (s), question 1 and the mean of questions 2-{n}")
    print(
        f"{'P':>2} | {'q1 off':>7} | {'q1 on':>7} | {'q2+ off':>8} | {'q2+ on':>7} | {'speed-up':>8} | "
        f"{'cached/question':>15} | identical"
    )
    for pcp, q1_off, q1_on, off, on, cached_per_question, same in doc_rows:
        print(
            f"{pcp:>2} | {q1_off:>7.3f} | {q1_on:>7.3f} | {off:>8.3f} | {on:>7.3f} | {off / on:>7.1f}x | "
            f"{cached_per_question:>15} | {same}/{n}"
        )
    if shared_row is not None:
        pcp, (e_off, o_off), (e_on, o_on) = shared_row
        tokens = sum(map(len, o_on))
        same = sum(a == b for a, b in zip(o_off, o_on))
        print(f"\nshared system prompt at P={pcp}: {args.requests} requests submitted at once")
        print(f"caching off: {tokens / e_off:7.1f} output tok/s ({e_off:.1f} s)")
        print(f"caching on:  {tokens / e_on:7.1f} output tok/s ({e_on:.1f} s)")
        print(f"throughput ratio on/off: {e_off / e_on:.2f}x; identical outputs {same}/{args.requests}")
