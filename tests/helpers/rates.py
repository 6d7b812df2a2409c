"""A HardwareProfile's Rates written as a table: {(kind, dtype): value} for a reference
rate, {(kind, dtype, hidden): value} for one measured over a layer of that width."""

from __future__ import annotations

from ctxpar.costmodel.rates import Rate, Rates

RateKey = tuple[str, str] | tuple[str, str, int]


def rates(table: dict[RateKey, float]) -> Rates:
    """The Rates of ``table``."""
    return Rates.of(Rate(key[0], key[1], value, key[2] if len(key) == 3 else None) for key, value in table.items())
