"""Knobs: dataclass fields that carry their command-line flag.

Each engine setting is written once, as an EngineConfig field made by ``knob``:
its default, type, help text and spelling on the command line. EngineArgs and
the engine flags of `ctxpar generate` and `ctxpar serve` are derived from those
fields (ctxpar/engine/arg_utils.py), so a new field appears everywhere at once
and the help cannot drift from the default. A knob's allowed values (its ``Range`` or
its ``choices``) sit on it too, and ``check_knobs`` checks them all at once. The
server's client limits are knobs the same way (ServerLimits,
ctxpar/entrypoints/openai/server_limits.py: `ctxpar serve`'s "client limits" flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ctxpar.checks import check_float, check_int
from ctxpar.errors import CtxparError

FLAG = "ctxpar.flag"  # the key of a knob's Flag in its field's metadata


@dataclass(frozen=True)
class Range:
    """The numbers a knob accepts: [lo, hi] (open ends where said), plus the special
    values in ``also`` (max_logprobs' -1: the whole vocabulary). An int knob is checked as
    an integer, a float knob as a finite number; None passes where the annotation allows it.
    ``hi`` may be a function, for a limit of this machine (num_threads)."""

    lo: float | None
    hi: float | Callable[[], int] | None = None
    lo_open: bool = False  # floats only
    hi_open: bool = False
    why: str = ""  # what the range means, appended to the message
    also: tuple[int, ...] = ()

    def check(self, name: str, value: object, kind: type, none_ok: bool) -> None:
        """Raise CtxparError, naming the knob, the value and the range, unless ``value`` is in it."""
        if (value is None and none_ok) or any(type(value) is type(a) and value == a for a in self.also):
            return
        hi = self.hi() if callable(self.hi) else self.hi
        if kind is int:
            check_int(name, value, self.lo, hi, none_ok=none_ok, why=self.why)  # type: ignore[arg-type]
        else:
            assert self.lo is not None  # a float range has a floor
            why = f"{self.why} or None" if none_ok else self.why
            check_float(name, value, self.lo, hi, lo_open=self.lo_open, hi_open=self.hi_open, why=why)


@dataclass(frozen=True)
class Flag:
    """How a knob reads on the command line, as ``--field-name`` (num_threads: --num-threads)."""

    help: str
    metavar: str | None = None  # the value's name in --help; none with choices (argparse lists them)
    aliases: tuple[str, ...] = ()  # other accepted spellings; for a boolean knob, of its --no- form
    choices: tuple[str, ...] | None = None
    range: Range | None = None  # the numbers it accepts (checked by check_knobs, not by argparse)


def knob(
    default: Any,
    help: str,
    metavar: str | None = None,
    *,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    range: Range | None = None,
) -> Any:
    """A dataclass field with ``default`` and its Flag. Typed Any, as ``dataclasses.field``
    is, so that ``block_size: int = knob(16, ...)`` type-checks."""
    return dataclasses.field(default=default, metadata={FLAG: Flag(help, metavar, aliases, choices, range)})


def knobs(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of dataclass ``cls`` made by ``knob``, in their order."""
    return [f for f in dataclasses.fields(cls) if FLAG in f.metadata]


def check_knobs(obj: object, skip: frozenset[str] = frozenset()) -> None:
    """Raise CtxparError for the first knob of dataclass instance ``obj`` whose value is
    outside its ``choices`` or its ``Range``. ``skip``: knobs whose own parsing checks them
    with a fuller message (a dtype also spelt as a torch dtype)."""
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    for f in knobs(cls):
        if f.name in skip:
            continue
        flag: Flag = f.metadata[FLAG]
        value = getattr(obj, f.name)
        none_ok = type(None) in typing.get_args(hints[f.name])
        if value is None and none_ok:
            continue
        if flag.choices is not None and not (isinstance(value, str) and value in flag.choices):
            raise CtxparError(f"{f.name} must be one of {', '.join(map(repr, flag.choices))}, got {value!r}")
        if flag.range is not None:
            flag.range.check(f.name, value, flag_type(cls, f.name), none_ok)


def flag_type(cls: type, name: str) -> type:
    """What the command line parses a knob's value as: the int, float or str of its
    annotation (``int | None``: int); anything else (a dict) is passed as its text,
    the JSON the field's own parsing takes."""
    hint = typing.get_type_hints(cls)[name]
    for t in (hint, *typing.get_args(hint)):
        if t in (int, float, str):
            return t
    return str


def add_flags(
    group: argparse._ArgumentGroup,
    cls: type,
    exclude: frozenset[str] = frozenset(),
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """One flag per knob of ``cls`` not in ``exclude``, with its default, into ``group``;
    returns the knobs' names (each flag's dest). ``defaults``: a command's own default for
    some knobs, in place of the class's (its help then states the command's)."""
    names = []
    for f in knobs(cls):
        if f.name in exclude:
            continue
        names.append(f.name)
        flag: Flag = f.metadata[FLAG]
        option = f"--{f.name.replace('_', '-')}"
        default = (defaults or {}).get(f.name, f.default)
        kwargs: dict[str, Any] = dict(dest=f.name, default=default, help=flag.help)
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
        if default is not None and "(default:" not in flag.help:
            kwargs["help"] = f"{flag.help} (default: {default})"
        group.add_argument(option, *flag.aliases, **kwargs)
    return names
