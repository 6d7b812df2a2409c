"""The ``ctxpar`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args)``. Modules keep heavy imports (torch, transformers) inside ``run``
so that ``ctxpar --help`` answers instantly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ctxpar.errors import CtxparError, RankFailure

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "calibrate": ("ctxpar.entrypoints.cli.calibrate", "measure this machine and save a hardware profile"),
    "estimate": ("ctxpar.entrypoints.cli.estimate", "predict TTFT, decode and memory of each CP layout"),
    "generate": ("ctxpar.entrypoints.cli.generate", "generate text, streamed to the terminal"),
    "plan": ("ctxpar.entrypoints.cli.plan", "show how a batch is split across PCP ranks"),
    "serve": ("ctxpar.entrypoints.cli.serve", "serve the model over an OpenAI-compatible HTTP API"),
}
BENCHMARKS: dict[str, tuple[str, str]] = {
    "compare": ("ctxpar.bench.compare", "the same workload through ctxpar and vLLM's CPU build, side by side"),
    "cuda": ("ctxpar.bench.cuda", "one rank on a GPU: logits and tokens vs transformers, TTFT and decode vs estimate"),
    "dcp": ("ctxpar.bench.dcp", "decode context parallelism: KV capacity, decode step and TTFT, D=P vs D=1"),
    "kernels": ("ctxpar.bench.kernels", "the compiled attention kernels vs the PyTorch path they replace"),
    "quant": (
        "ctxpar.bench.quant",
        "decode with a GGUF kept quantized vs dequantized to fp32 and bf16, as a multiple of its floor",
    ),
    "planner": ("ctxpar.bench.planner", "PCP layout planner: vectorised vs loop baseline"),
    "policy": ("ctxpar.bench.policy", "the automatic PCP policy vs fixed settings: mixed, long and short workloads"),
    "long": ("ctxpar.bench.long", "exactness at 32K tokens: P ranks and D = P against one rank, SmolLM2's shapes"),
    "overhead": ("ctxpar.bench.overhead", "host work per step (scheduler, layout, slots) at 8K-128K cached tokens"),
    "links": ("ctxpar.bench.links", "P = 2 on two namespaces over tbf-shaped links (1-100 Gbit/s, RDMA) vs one core"),
    "recovery": ("ctxpar.bench.recovery", "a SIGKILLed rank: time to recover vs the prefill a restart redoes"),
    "prefix": ("ctxpar.bench.prefix", "prefix caching: repeated-prefix TTFT and throughput, on vs off"),
    "serve": ("ctxpar.bench.serve", "the HTTP server under a concurrency sweep vs offline LLM.generate"),
    "soak": ("ctxpar.bench.soak", "the HTTP server under random request mixes and client aborts for a long time"),
    "structured": ("ctxpar.bench.structured", "a batch of JSON-schema requests vs the same batch unconstrained"),
    "spec": ("ctxpar.bench.spec", "speculative decoding (n-gram): decode tokens/s on vs off, copy and free text"),
    "throughput": ("ctxpar.bench.throughput", "offline throughput vs transformers"),
    "ttft": ("ctxpar.bench.ttft", "time to first token with PCP ranks vs one rank"),
}


def _add(subparsers: argparse._SubParsersAction, name: str, module: str, help: str, load: bool = True) -> None:
    if not load:  # listed (its one-line help) but not imported: another command was named
        subparsers.add_parser(name, help=help)
        return
    mod = importlib.import_module(module)
    p = subparsers.add_parser(name, help=help, description=(mod.__doc__ or help).strip().split("\n\n")[0])
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command. With ``argv``, only the module of the command it
    names is imported: a command does not need the others' dependencies (serve's
    pydantic, say, on a GPU machine without them)."""
    command = argv[0] if argv else None
    benchmark = argv[1] if argv is not None and len(argv) > 1 and command == "bench" else None
    parser = argparse.ArgumentParser(
        prog="ctxpar",
        description="ctxpar: context-parallel LLM inference. Long prompts are split "
        "across ranks so time-to-first-token falls with the number of ranks, "
        "while the output stays exactly that of one rank.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help) in COMMANDS.items():
        _add(sub, name, module, help, load=argv is None or name == command)
    bench = sub.add_parser("bench", help="benchmarks that print a ratio against a baseline")
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module, help) in BENCHMARKS.items():
        _add(bench_sub, name, module, help, load=argv is None or name == benchmark)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Exit status: 0 ok, 2 a user mistake (CtxparError),
    1 a runtime failure of the ranks (RankFailure), 130 interrupted (Ctrl-C);
    each failure is one ``error: ...`` line on stderr, without a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        args._run(args)
    except CtxparError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ctxpar plan ... | head`): nothing is wrong. Point stdout
        # at /dev/null so that Python's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell tool killed by it
    return 0


if __name__ == "__main__":
    sys.exit(main())
