"""The ``ctxpar`` command line: the product's commands.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args)``. Modules keep heavy imports (torch, transformers) inside ``run``
so that ``ctxpar --help`` answers instantly. The ``ctxpar`` command itself
(ctxpar/cli.py) adds the benchmarks, ``ctxpar bench``, which sit above the
product: nothing here imports them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from ctxpar.errors import CtxparError, RankFailure


@dataclass(frozen=True)
class CommandTable:
    """Subcommands: each one's one-line help, and ``load(name)``, which imports the named
    command's module only when it is run (or every parser is built): a command does not
    need the others' dependencies (serve's pydantic, say, on a GPU machine without them).
    ``load`` spells each import out, not built from a string, so that the import graph
    (tests/architecture/test_layering.py) sees every command's module."""

    help: Mapping[str, str]
    load: Callable[[str], ModuleType]
    metavar: str = "COMMAND"  # what the usage line calls one (its parsed name's key: lowercase)


def _load_command(name: str) -> ModuleType:
    match name:
        case "calibrate":
            from ctxpar.entrypoints.cli import calibrate

            return calibrate
        case "estimate":
            from ctxpar.entrypoints.cli import estimate

            return estimate
        case "generate":
            from ctxpar.entrypoints.cli import generate

            return generate
        case "plan":
            from ctxpar.entrypoints.cli import plan

            return plan
        case "serve":
            from ctxpar.entrypoints.cli import serve

            return serve
    raise KeyError(name)


COMMANDS = CommandTable(
    help={
        "calibrate": "measure this machine and save a hardware profile",
        "estimate": "predict TTFT, decode and memory of each CP layout",
        "generate": "generate text, streamed to the terminal",
        "plan": "show how a batch is split across PCP ranks",
        "serve": "serve the model over an OpenAI-compatible HTTP API",
    },
    load=_load_command,
)
# A group of subcommands under one name (`ctxpar bench NAME`): name -> (one-line help, its table).
Groups = Mapping[str, tuple[str, CommandTable]]


def _add(subparsers: argparse._SubParsersAction, name: str, table: CommandTable, load: bool = True) -> None:
    help = table.help[name]
    if not load:  # listed (its one-line help) but not imported: another command was named
        subparsers.add_parser(name, help=help)
        return
    mod = table.load(name)
    p = subparsers.add_parser(name, help=help, description=(mod.__doc__ or help).strip().split("\n\n")[0])
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: Sequence[str] | None = None, groups: Groups | None = None) -> argparse.ArgumentParser:
    """The parser of every command, and of every group's. With ``argv``, only the module
    of the command it names is imported."""
    command = argv[0] if argv else None
    parser = argparse.ArgumentParser(
        prog="ctxpar",
        description="ctxpar: context-parallel LLM inference. Long prompts are split "
        "across ranks so time-to-first-token falls with the number of ranks, "
        "while the output stays exactly that of one rank.",
    )
    sub = parser.add_subparsers(dest=COMMANDS.metavar.lower(), metavar=COMMANDS.metavar, required=True)
    for name in COMMANDS.help:
        _add(sub, name, COMMANDS, load=argv is None or name == command)
    for group, (help, table) in (groups or {}).items():
        named = argv[1] if argv is not None and len(argv) > 1 and command == group else None
        group_sub = sub.add_parser(group, help=help).add_subparsers(
            dest=table.metavar.lower(), metavar=table.metavar, required=True
        )
        for name in table.help:
            _add(group_sub, name, table, load=argv is None or name == named)
    return parser


def main(argv: list[str] | None = None, groups: Groups | None = None) -> int:
    """Run one subcommand (of ``groups`` too). Exit status: 0 ok, 2 a user mistake
    (CtxparError), 1 a runtime failure of the ranks (RankFailure), 130 interrupted
    (Ctrl-C); each failure is one ``error: ...`` line on stderr, without a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv, groups).parse_args(argv)
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
