"""vLLM's small helpers that scripts import (``vllm.utils``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def _dashes(arg: str) -> str:
    """ "--max_model_len=8" -> "--max-model-len=8"; values and positionals as they are."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's ArgumentParser: ``--max_model_len`` means ``--max-model-len``."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        given = sys.argv[1:] if args is None else args
        return super().parse_args([_dashes(a) for a in given], namespace)
