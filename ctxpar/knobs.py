"""Knobs: dataclass fields that carry their command-line flag.

Each engine setting is written once, as an EngineConfig field made by ``knob``:
its default, type, help text and spelling on the command line. EngineArgs and
the engine flags of `ctxpar generate` and `ctxpar serve` are derived from those
fields (ctxpar/engine/arg_utils.py), so a new field appears everywhere at once
and the help cannot drift from the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

FLAG = "ctxpar.flag"  # the key of a knob's Flag in its field's metadata


@dataclass(frozen=True)
class Flag:
    """How a knob reads on the command line, as ``--field-name`` (num_threads: --num-threads)."""

    help: str
    metavar: str | None = None  # the value's name in --help; none with choices (argparse lists them)
    aliases: tuple[str, ...] = ()  # other accepted spellings; for a boolean knob, of its --no- form
    choices: tuple[str, ...] | None = None


def knob(
    default: Any,
    help: str,
    metavar: str | None = None,
    *,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field with ``default`` and its Flag. Typed Any, as ``dataclasses.field``
    is, so that ``block_size: int = knob(16, ...)`` type-checks."""
    return dataclasses.field(default=default, metadata={FLAG: Flag(help, metavar, aliases, choices)})


def knobs(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass ``cls`` made by ``knob``, in their order."""
    return [f for f in dataclasses.fields(cls) if FLAG in f.metadata]


def flag_type(cls: type, name: str) -> type:
    """What the command line parses a knob's value as: the int, float or str of its
    annotation (``int | None``: int); anything else (a dict) is passed as its text,
    the JSON the field's own parsing takes."""
    hint = typing.get_type_hints(cls)[name]
    for t in (hint, *typing.get_args(hint)):
        if t in (int, float, str):
            return t
    return str


def add_flags(group: argparse._ArgumentGroup, cls: type, exclude: frozenset[str] = frozenset()) -> list[str]:
    """One flag per knob of ``cls`` not in ``exclude``, with its default, into ``group``;
    returns the knobs' names (each flag's dest)."""
    names = []
    for f in knobs(cls):
        if f.name in exclude:
            continue
        names.append(f.name)
        flag: Flag = f.metadata[FLAG]
        option = f"--{f.name.replace('_', '-')}"
        kwargs: dict[str, Any] = dict(dest=f.name, default=f.default, help=flag.help)
        if isinstance(f.default, bool):
            # --x and --no-x; an alias is another spelling of the --no- form.
            group.add_argument(option, action=argparse.BooleanOptionalAction, **kwargs)
            for alias in flag.aliases:
                group.add_argument(alias, dest=f.name, action="store_false", help=argparse.SUPPRESS)
            continue
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        else:
            kwargs["metavar"] = flag.metavar
            kwargs["type"] = flag_type(cls, f.name)
        if f.default is not None and "(default:" not in flag.help:
            kwargs["help"] = f"{flag.help} (default: {f.default})"
        group.add_argument(option, *flag.aliases, **kwargs)
    return names
