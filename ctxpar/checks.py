"""Value checks shared by every boundary where user input enters ctxpar.

SamplingParams, EngineConfig and the command line all refuse bad values with
the same messages: the field, the value received and the allowed range. One
implementation, so a limit cannot drift between the library and the CLI.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from ctxpar.errors import CtxparError


def is_int(value: object) -> bool:
    """An integer and not a bool (``True`` is an ``int`` in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _range(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if hi is None:
        return f"> {lo}" if lo_open else f">= {lo}"
    if lo is None:
        return f"< {hi}" if hi_open else f"<= {hi}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def in_int_range(value: object, lo: int | None, hi: int | None = None) -> bool:
    """Whether ``value`` is an integer in [lo, hi] (a None bound: unbounded)."""
    return is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi)  # type: ignore[operator]


def check_int(
    name: str, value: object, lo: int | None, hi: int | None = None, *, none_ok: bool = False, why: str = ""
) -> None:
    """Raise CtxparError unless ``value`` is an integer in [lo, hi] (or None when ``none_ok``).

    why: the reason for the limit, appended to the message.
    """
    if value is None and none_ok:
        return
    if not in_int_range(value, lo, hi):
        alt = " or None" if none_ok else ""
        raise CtxparError(f"{name} must be an integer {_range(lo, hi)}{alt}{why}, got {value!r}")


def check_float(
    name: str,
    value: object,
    lo: float,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    why: str = "",
) -> None:
    """Raise CtxparError unless ``value`` is a finite real number in the given range.

    why: what the range means, appended to the range in the message.
    """
    limit = f"{_range(lo, hi, lo_open, hi_open)}{why}"
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise CtxparError(f"{name} must be a finite number {limit}, got {value!r}")
    above = value > lo if lo_open else value >= lo
    below = hi is None or (value < hi if hi_open else value <= hi)
    if not (above and below):
        raise CtxparError(f"{name} must be {limit}, got {value!r}")


def machine_memory_bytes() -> int:
    """Physical memory of this machine (all of it, not what is free now: a stable limit)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


THREADS_PER_CORE = 4  # more torch threads than this per core only add contention


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def max_threads() -> int:
    """The most torch threads per rank ctxpar accepts on this machine."""
    return THREADS_PER_CORE * usable_cores()


# -- argparse types: the same limits as an argparse error (usage line, exit 2) --


def int_arg(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` that accepts an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or not in_int_range(value, lo, hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_range(lo, hi)}, got {text!r}")
        return value

    parse.__name__ = f"integer {_range(lo, hi)}"  # argparse names the type in some messages
    return parse


def fraction(text: str) -> float:
    """An argparse ``type=`` that accepts a number in [0, 1] (a rate)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


positive_int = int_arg(1)
nonnegative_int = int_arg(0)
