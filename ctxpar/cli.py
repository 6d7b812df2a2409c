"""The ``ctxpar`` command (its script, and ``python -m ctxpar.cli``): the product's
commands (ctxpar/entrypoints/cli/main.py) and, under ``ctxpar bench``, the
benchmarks (ctxpar/bench/catalog.py). The two meet here, above every floor of
the package, because nothing in the product may import the benchmarks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ctxpar.bench.catalog import BENCHMARKS
from ctxpar.entrypoints.cli import main as product

__all__ = ["build_parser", "main"]

GROUPS: product.Groups = {"bench": ("benchmarks that print a ratio against a baseline", BENCHMARKS)}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser, the benchmarks' included (see product.build_parser)."""
    return product.build_parser(argv, GROUPS)


def main(argv: list[str] | None = None) -> int:
    """Run one command or benchmark (see product.main for the exit status)."""
    return product.main(argv, GROUPS)


if __name__ == "__main__":
    sys.exit(main())
