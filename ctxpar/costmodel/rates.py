"""The rates `ctxpar calibrate` measured, by dtype and layer width: one calibration prices
every weight dtype, every activation dtype and every model width.

A HardwareProfile prices with one rate of each kind (its fields); ``Rates`` keeps every
rate measured, each a ``Rate`` keyed by its kind, its dtype and the hidden size of the
layer it was measured over, from which HardwareProfile.with_weight_dtype,
with_activation_dtype and for_model take theirs. A kind or dtype that does not exist is
refused when the record is made (a stored profile: when it loads), never looked up and
silently missed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from ctxpar.errors import CtxparError

# Each kind's dtype is the weights' (the projections' two rates) or the activations' (the
# others). The two overheads are the host's cost of a step and of a layer, in seconds.
RateKind = Literal[
    "gemm_flops",
    "weight_read_bandwidth",
    "attention_flops",
    "kv_read_bandwidth",
    "elementwise_bandwidth",
    "step_overhead_s",
    "layer_overhead_s",
]
RATE_KINDS: tuple[str, ...] = get_args(RateKind)
# The cost model's dtypes and their bytes a value (q4: GGUF's Q4_0, 18 bytes a block of 32).
DTYPE_BYTES = {"fp8": 1.0, "int8": 1.0, "q4": 0.5625, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}


@dataclass(frozen=True)
class Rate:
    """One measured rate: its kind, its dtype, and the hidden size of the layer it was
    measured over (None: the calibration's reference shapes, the profile's own rate)."""

    kind: RateKind
    dtype: str
    value: float
    hidden: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in RATE_KINDS:
            raise CtxparError(f"rate kind {self.kind!r} is not one of {', '.join(RATE_KINDS)}")
        if self.dtype not in DTYPE_BYTES:
            raise CtxparError(f"rate {self.kind}: dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise CtxparError(f"rate {self.kind} {self.dtype}: value must be a finite number >= 0, got {v!r}")
        if self.hidden is not None and (isinstance(self.hidden, bool) or not isinstance(self.hidden, int)):
            raise CtxparError(f"rate {self.kind} {self.dtype}: hidden must be an integer or None, got {self.hidden!r}")
        if self.hidden is not None and self.hidden < 1:
            raise CtxparError(f"rate {self.kind} {self.dtype}: hidden must be >= 1, got {self.hidden}")


@dataclass(frozen=True)
class Rates:
    """Every rate measured for one rank, at most one per (kind, dtype, hidden)."""

    measured: tuple[Rate, ...] = ()

    def __post_init__(self) -> None:
        rates = tuple(r if isinstance(r, Rate) else Rate(**r) for r in self.measured)  # a stored profile's dicts
        object.__setattr__(self, "measured", rates)
        keys = [(r.kind, r.dtype, r.hidden) for r in rates]
        if len(set(keys)) != len(keys):
            twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
            raise CtxparError(f"rates measured twice: {twice}")

    @classmethod
    def of(cls, rates: Iterable[Rate]) -> Rates:
        return cls(tuple(rates))

    def __or__(self, other: Rates) -> Rates:
        return Rates(self.measured + other.measured)

    def get(self, kind: RateKind, dtype: str) -> float | None:
        """The reference rate of ``kind`` in ``dtype``, or None where not measured."""
        return next((r.value for r in self.measured if (r.kind, r.dtype, r.hidden) == (kind, dtype, None)), None)

    def nearest(self, kind: RateKind, dtype: str, hidden: int) -> float | None:
        """The rate of ``kind`` in ``dtype`` measured over the layer whose hidden size is
        nearest ``hidden`` (by ratio), or None where none was measured by width."""
        widths = {r.hidden: r.value for r in self.measured if r.kind == kind and r.dtype == dtype and r.hidden}
        if not widths:
            return None
        return widths[min(widths, key=lambda size: abs(math.log2(size / hidden)))]

    def dtypes(self, kind: RateKind) -> list[str]:
        """The dtypes ``kind`` has a reference rate in, sorted."""
        return sorted({r.dtype for r in self.measured if r.kind == kind and r.hidden is None})


# A stored profile's note of a rate, as profiles were saved before Rates: "<kind>_<dtype>",
# or "<kind>_<dtype>_hidden<size>" for a rate measured over a layer of that width.
_NOTE = re.compile(rf"^({'|'.join(RATE_KINDS)})_({'|'.join(DTYPE_BYTES)})(?:_hidden(\d+))?$")


def rates_from_notes(notes: dict[str, Any]) -> tuple[Rates, dict[str, Any]]:
    """A profile saved with its rates as notes, converted: the Rates those notes hold, and
    the other notes (the measurements kept for the record: threads, the links' fits)."""
    rates, rest = [], {}
    for key, value in notes.items():
        m = _NOTE.match(key)
        if m is None:
            rest[key] = value
            continue
        kind, dtype, hidden = m.groups()
        rates.append(Rate(cast(RateKind, kind), dtype, value, int(hidden) if hidden else None))  # _NOTE's kinds
    return Rates.of(rates), rest
