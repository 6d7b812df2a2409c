"""SIGTERM's bound holds when nothing cooperates: rank 1 is frozen (SIGSTOP) in
the middle of a step, so rank 0's step waits in a collective for 30 s; the
watchdog still kills the ranks and ends the process at the grace period + 5 s.
Nor does a stderr without a reader keep the server from stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ctxpar.bench.server_process import wait_healthy
from helpers.server_harness import Server, alive, free_port
from helpers.tiny_tokenizer import with_byte_tokenizer

pytestmark = pytest.mark.multiprocess  # a server and its rank processes

GRACE_S = 1
STOP_MARGIN_S = 5  # ctxpar/entrypoints/openai/shutdown.py


def test_sigterm_with_a_frozen_rank_ends_within_the_bound(tiny_model_dirs, tmp_path):
    model = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path / "llama")
    args = ["--model", str(model), "--threads", "1", "--pcp", "2", "--pcp-min-tokens", "0"]
    server = Server([*args, "--timeout-graceful-shutdown", str(GRACE_S)], log=tmp_path / "server.log")
    ranks = server.descendants()
    rank1 = server.rank_pid()
    body = {"prompt": "frozen", "max_tokens": 480, "ignore_eos": True, "n": 8, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        os.kill(rank1, signal.SIGSTOP)  # the next step's collectives wait for it
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(GRACE_S + STOP_MARGIN_S + 5)
        elapsed = time.monotonic() - t0
    assert code == 1 and "did not stop in time: killing the PCP ranks" in server.log(), server.log()
    assert GRACE_S + STOP_MARGIN_S - 1 < elapsed < GRACE_S + STOP_MARGIN_S + 2
    deadline = time.monotonic() + 10
    while any(alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if alive(p)]  # the frozen rank was killed too
    assert "Traceback" not in server.log()
    server.stop()  # closes its log


def test_sigterm_stops_a_server_whose_stderr_reader_is_gone(tiny_model_dirs, tmp_path):
    """The benchmark or supervisor that started the server was killed: its stderr pipe
    has no reader, so the shutdown's first message fails (EPIPE). It must still stop,
    with status 0, as promptly as with a reader."""
    model = with_byte_tokenizer(tiny_model_dirs["llama"], tmp_path / "llama")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxpar.cli", "serve", "--port", str(port), "--model", str(model), "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_healthy(proc, port, "ctxpar serve", timeout=120)
        assert proc.stderr is not None and proc.stdout is not None
        proc.stderr.close()  # the reader is gone: the server's next write to stderr fails
        proc.stdout.close()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(GRACE_S + STOP_MARGIN_S + 5)
        assert code == 0 and time.monotonic() - t0 < 5
    finally:
        proc.kill()
        proc.wait()
