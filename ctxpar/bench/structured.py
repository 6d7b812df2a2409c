"""Structured outputs: a batch of JSON-schema requests against the same batch unconstrained.

1. Throughput. R chat requests, each asking for a JSON object of one of a few
   schemas (nested objects, arrays, enums, bounded numbers), generated with the
   grammar; then the same prompts without it, each request generating exactly
   as many tokens as its constrained run did (EOS ignored), so both runs do the
   same model work in batches of the same shape and the ratio is the cost of
   the grammar: compiling, filling each row's bitmask, masking, accepting.
   Rounds alternate which runs first; the best of each is printed. Also counted: the
   constrained outputs that parse as JSON.
2. Compile time: a schema never seen before (first request) against the same
   schema again (cached), through the engine's grammar backend.
"""

from __future__ import annotations

import argparse
import time

from ctxpar.checks import int_arg, max_threads, positive_int

SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 32},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        },
        "required": ["city", "temperature", "conditions"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 12},
                    "last": {"type": "string", "maxLength": 12},
                },
                "required": ["first", "last"],
            },
        },
        "required": ["title", "tags", "author"],
    },
]
TOPICS = ["a person", "today's weather somewhere", "a book", "a friend", "a city's weather", "a blog post"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("--model", metavar="PATH", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=positive_int, default=32, metavar="N", help="requests per batch (default: 32)")
    p.add_argument(
        "--max-tokens", type=positive_int, default=128, metavar="N", help="tokens per request at most (default: 128)"
    )
    p.add_argument("--rounds", type=positive_int, default=2, metavar="N", help="alternating rounds (default: 2)")
    p.add_argument("--threads", type=int_arg(1, max_threads()), metavar="N", help="torch threads (default: all cores)")


def _prompts(llm, n: int) -> list[dict]:
    return [
        llm.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}])[0]
        for i in range(n)
    ]


def _run(llm, prompts: list[dict], params: list) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def _compile_times(llm) -> tuple[float, float]:
    """Seconds to parse and compile a new schema, and to get it again from the cache."""
    from ctxpar.sampling_params import StructuredOutputsParams

    backend = llm.engine.structured.backend  # the compile alone: a request would time its decode too
    schema = dict(SCHEMAS[2], title=f"unseen-{time.time_ns()}")  # a key no earlier request had
    times = []
    for _ in range(2):
        start = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema)).result()
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def run(args: argparse.Namespace) -> None:
    import json

    from ctxpar import LLM, SamplingParams
    from ctxpar.bench.machine_line import describe_machine
    from ctxpar.sampling_params import StructuredOutputsParams

    print(describe_machine())
    with LLM(args.model, num_threads=args.threads, quantization="none") as llm:
        prompts = _prompts(llm, args.requests)
        constrained = [
            SamplingParams(
                temperature=0,
                max_tokens=args.max_tokens,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]),
            )
            for i in range(args.requests)
        ]
        # Warm-up (every schema compiled, every prompt cached), and the lengths the unconstrained run copies.
        _, outs = _run(llm, prompts, constrained)
        lengths = [len(o.token_ids) for o in outs]
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        tokens = sum(lengths)
        best_c, best_u = float("inf"), float("inf")
        for r in range(args.rounds):
            # Alternate which goes first, so a machine that warms up or slows down favours neither.
            order = ["c", "u"] if r % 2 == 0 else ["u", "c"]
            times = {}
            for mode in order:
                times[mode], got = _run(llm, prompts, constrained if mode == "c" else free)
                if mode == "c":
                    outs = got
            t_c, t_u = times["c"], times["u"]
            best_c, best_u = min(best_c, t_c), min(best_u, t_u)
            print(
                f"round {r + 1}: {tokens} tokens, constrained {tokens / t_c:.1f} tok/s, "
                f"unconstrained {tokens / t_u:.1f} tok/s"
            )
        valid = 0
        for o in outs:
            try:
                json.loads(o.text)
                valid += 1
            except ValueError:
                pass
        first, cached = _compile_times(llm)
    print(f"outputs that parse as JSON: {valid}/{args.requests} (mean {tokens / args.requests:.1f} tokens)")
    print(f"throughput, best round: constrained {tokens / best_c:.1f} tok/s vs unconstrained {tokens / best_u:.1f}")
    print(f"ratio constrained / unconstrained: {best_u / best_c:.3f}x (goal >= 0.9x)")
    print(f"schema compile: first {first * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
