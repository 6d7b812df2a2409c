"""SIGTERM's bound holds when nothing cooperates: rank 1 is frozen (SIGSTOP) in
the middle of a step, so rank 0's step waits in a collective for 30 s; the
watchdog still kills the ranks and ends the process at the grace period + 5 s."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from helpers.server_harness import Server, alive
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
