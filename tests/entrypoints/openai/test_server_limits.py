"""`ctxpar serve --pcp 2` at its limits, and /health: a full queue is a 503 with
Retry-After (and /health says "degraded"); a rank killed while the server is
idle is found within a second, without any request: /health says
"recovering", then "healthy" once it is respawned; killed again beyond
--max-rank-recoveries, /health turns to 503 "dead". /metrics counts both."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from helpers.server_harness import STOPPED, Server, alive

pytestmark = pytest.mark.multiprocess  # a server and its rank processes

# Long enough (seconds of SmolLM2 decoding) to still run while the test looks at the queue.
LONG = {"prompt": "long", "max_tokens": 300, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--threads", "1", "--pcp", "2", "--max-model-len", "512"]  # the default model, SmolLM2-135M
    args += ["--limit-concurrency", "1", "--max-queued-requests", "1", "--max-rank-recoveries", "1"]
    s = Server(args, log=tmp_path_factory.mktemp("limits_log") / "server.log")
    yield s
    assert s.stop() in STOPPED, s.log()  # and no rank outlives it


def health(server) -> tuple[int, dict]:
    r = httpx.get(server.url + "/health", timeout=30)
    return r.status_code, r.json()


def test_full_queue_is_a_503_with_retry_after(server):
    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", server.url + "/v1/completions", json=LONG) as running:
                lines = running.aiter_lines()  # kept: dropping it would close the stream
                await anext(lines)  # the one slot is taken
                short = {**LONG, "max_tokens": 2}
                queued = asyncio.create_task(client.post(server.url + "/v1/completions", json=short))
                deadline = time.monotonic() + 30
                while (h := await client.get(server.url + "/health")).json()["requests_queued"] == 0:
                    assert time.monotonic() < deadline, h.json()
                    await asyncio.sleep(0.02)
                assert h.status_code == 200 and h.json()["status"] == "degraded"  # serving, at its limits
                refused = await client.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                err = refused.json()["error"]
                assert err["code"] == 503 and err["type"] == "service_unavailable" and "limit" in err["message"]
            # The running stream was left (aborted); the queued request gets the slot and finishes.
            assert (await queued).status_code == 200

    asyncio.run(run())
    server.wait_idle()
    assert health(server)[1]["status"] == "healthy"


def kill_rank_and_wait(server, leaving: str) -> dict:
    """Kill rank 1 while idle; /health's body once its status is no longer ``leaving``."""
    worker = server.rank_pid()
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    while (h := health(server))[1]["status"] == leaving:
        assert time.monotonic() - t0 < 5, h  # found within the engine thread's idle poll
        time.sleep(0.05)
    assert not alive(worker)
    return h[1]


def test_health_follows_a_rank_killed_while_idle(server):
    """No request runs when rank 1 dies: /health finds it by itself, says "recovering"
    while it is respawned, then "healthy" again; the second loss is beyond
    --max-rank-recoveries 1: "dead", and requests get a 503 naming the failure."""
    status, body = health(server)
    assert status == 200 and body["status"] == "healthy" and body["rank_failures"] == 0
    assert kill_rank_and_wait(server, "healthy")["status"] == "recovering"
    t0 = time.monotonic()
    while (h := health(server))[1]["status"] == "recovering":
        assert time.monotonic() - t0 < 120, h
        time.sleep(0.1)
    assert h == (200, {**h[1], "status": "healthy", "rank_failures": 1, "rank_recoveries": 1})
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text

    body = kill_rank_and_wait(server, "healthy")
    assert body["status"] == "dead" and body["rank_failures"] == 2 and body["rank_recoveries"] == 1
    message = body["error"]["message"]
    assert "PCP rank 1" in message and "SIGKILL" in message and "max_rank_recoveries" in message
    m = server.metrics()
    assert m["ctxpar:rank_failures_total"] == 2 and m["ctxpar:rank_recoveries_total"] == 1
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "PCP rank 1" in r.json()["error"]["message"]
