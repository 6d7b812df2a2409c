"""`ctxpar serve`'s client-limit flags are made from ServerLimits' knobs
(ctxpar/entrypoints/openai/server_limits.py): one flag per limit with its default,
and a value out of its knob's range refused, naming it, before a model is loaded."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ctxpar.entrypoints.cli import serve
from ctxpar.entrypoints.openai.server_limits import ServerLimits
from ctxpar.errors import CtxparError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_every_limit_is_a_flag_with_its_default():
    assert serve._limits(parse()) == ServerLimits()
    flags = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ServerLimits)]
    given = parse(*[x for flag in flags for x in (flag, "7")])
    assert all(v == 7 for v in dataclasses.asdict(serve._limits(given)).values())


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-connections", "0"], "max_connections must be an integer >= 1, got 0"),
        (["--timeout-header", "inf"], "timeout_header must be a finite number > 0"),
        (["--grammar-compile-timeout", "0"], "grammar_compile_timeout must be > 0"),
        (["--max-queued-requests", "-1"], "max_queued_requests must be an integer >= 0"),
        (["--max-body-size", "10", "--max-body-bytes-in-flight", "5"], "--max-body-bytes-in-flight (5)"),
    ],
)
def test_a_limit_out_of_its_range_is_refused(argv, words):
    with pytest.raises(CtxparError, match=words.replace("(", r"\(").replace(")", r"\)")):
        serve._limits(parse(*argv))
