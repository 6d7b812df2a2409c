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
class Command:
    """A subcommand: its one-line help, and ``load()``, which imports its module only when it
    is run (or every parser is built): a command does not need the others' dependencies
    (serve's pydantic, say, on a GPU machine without them). ``load`` spells its import out,
    not built from a string, so that the import graph (tests/architecture/test_layering.py)
    sees every command's module."""

    help: str
    load: Callable[[], ModuleType]


@dataclass(frozen=True)
class CommandTable:
    """Subcommands by name, in the order they are listed."""

    commands: Mapping[str, Command]
    metavar: str = "COMMAND"  # what the usage line calls one (its parsed name's key: lowercase)

    @property
    def help(self) -> dict[str, str]:
        """Each command's one-line help."""
        return {name: command.help for name, command in self.commands.items()}

    def load(self, name: str) -> ModuleType:
        """The named command's module, imported now."""
        return self.commands[name].load()


def _calibrate() -> ModuleType:
    from ctxpar.entrypoints.cli import calibrate

    return calibrate


def _estimate() -> ModuleType:
    from ctxpar.entrypoints.cli import estimate

    return estimate


def _generate() -> ModuleType:
    from ctxpar.entrypoints.cli import generate

    return generate


def _plan() -> ModuleType:
    from ctxpar.entrypoints.cli import plan

    return plan


def _serve() -> ModuleType:
    from ctxpar.entrypoints.cli import serve

    return serve


COMMANDS = CommandTable(
    {
        "calibrate": Command("measure this machine and save a hardware profile", _calibrate),
        "estimate": Command("predict TTFT, decode and memory of each CP layout", _estimate),
        "generate": Command("generate text, streamed to the terminal", _generate),
        "plan": Command("show how a batch is split across PCP ranks", _plan),
        "serve": Command("serve the model over an OpenAI-compatible HTTP API", _serve),
    }
)
# A group of subcommands under one name (`ctxpar bench NAME`): name -> (one-line help, its table).
Groups = Mapping[str, tuple[str, CommandTable]]


def _add(subparsers: argparse._SubParsersAction, name: str, command: Command, load: bool = True) -> None:
    help = command.help
    if not load:  # listed (its one-line help) but not imported: another command was named
        subparsers.add_parser(name, help=help)
        return
    mod = command.load()
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
    for name, cmd in COMMANDS.commands.items():
        _add(sub, name, cmd, load=argv is None or name == command)
    for group, (help, table) in (groups or {}).items():
        named = argv[1] if argv is not None and len(argv) > 1 and command == group else None
        group_sub = sub.add_parser(group, help=help).add_subparsers(
            dest=table.metavar.lower(), metavar=table.metavar, required=True
        )
        for name, cmd in table.commands.items():
            _add(group_sub, name, cmd, load=argv is None or name == named)
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
