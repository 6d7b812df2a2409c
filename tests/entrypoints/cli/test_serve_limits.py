"""`ctxpar serve`'s client-limit flags are made from ServerLimits' knobs
(ctxpar/entrypoints/openai/server_limits.py): one flag per limit with its default,
and a value out of its knob's range refused, naming it, before a model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import resource
import subprocess
import sys

import pytest

from ctxpar.entrypoints.cli import serve
from ctxpar.entrypoints.openai.connections import OWN_DESCRIPTORS
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


def _run_limited(soft: int, hard: int, argv: list[str]) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=limit, timeout=120)


def test_more_connections_than_descriptors_is_refused_before_loading():
    """A cap on connections above the descriptors the process may open would never be
    reached: accept() fails first and every new client hangs. serve refuses it at start."""
    r = _run_limited(200, 300, [sys.executable, "-m", "ctxpar.cli", "serve", "--max-connections", "1024"])
    assert r.returncode == 2, r.stderr
    assert "--max-connections 1024 needs 1280 file descriptors" in r.stderr
    assert "lower --max-connections to 44" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_soft_descriptor_limit_is_raised_to_fit_the_connections():
    code = (
        "import resource\n"
        "from ctxpar.entrypoints.openai.connections import reserve_descriptors\n"
        "print(reserve_descriptors(1024), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    r = _run_limited(200, 4096, [sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(1024 + OWN_DESCRIPTORS)] * 2
